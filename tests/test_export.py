"""``lightning-dist export CKPT OUT --format hf|litgpt`` (issue 42, item 5): stock Hugging Face models and litgpt's
``GPT`` inside a LightningModule, trained two steps by a real Trainer under fsdp2 in one process, exported from the
sharded folder or the single file the strategy saved; the exports load strictly and give the trained model's logits.

The exports of 2-rank fsdp2, tensor_parallel and pipeline checkpoints are in tests/test_hf_init.py (its launch).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors import safe_open

import lightning_dist
from lightning_dist import FullStateCheckpointIO
from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.export import export_checkpoint
from lightning_dist.checkpoint.export.shards import parse_size
from lightning_dist.checkpoint.export_target import EXPORT_FOLDER_MARKER
from lightning_dist.cli import main as cli_main
from tests.scenarios.models import tiny_hf_causal_lm

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


class Wrapped(L.LightningModule):
    """A pretrained model in ``self.model``, as users hold it; the LightningModule prefix is ``model.``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = _logits(self.model, batch[0])
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[0][:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    output = model(tokens)
    return output if torch.is_tensor(output) else output.logits


def _litgpt() -> torch.nn.Module:
    from litgpt.config import Config
    from litgpt.model import GPT

    return GPT(Config(n_layer=2, n_embd=32, n_head=4, n_query_groups=2, vocab_size=64, padded_vocab_size=64,
                      block_size=16, mlp_class_name="LLaMAMLP", intermediate_size=64))  # fmt: skip


def _trained(model: torch.nn.Module, path: Path, single_file: bool = False) -> Wrapped:
    """``model`` in a LightningModule after two AdamW steps under fsdp2 (one process), saved at ``path``: a sharded
    folder, or a single file with ``single_file``."""
    torch.manual_seed(0)
    module = Wrapped(model)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 64, (8, 8))), batch_size=4)
    strategy = lightning_dist.FSDP2Strategy(checkpoint_io=FullStateCheckpointIO() if single_file else None)
    trainer = L.Trainer(strategy=strategy, devices=1, accelerator="cpu", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(module, data)
    trainer.save_checkpoint(path)
    module.eval()
    return module


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (checkpoint path, the trained LightningModule)."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    models = {
        "llama": (tiny_hf_causal_lm("llama"), False),
        "gpt2": (tiny_hf_causal_lm("gpt2"), True),  # tied lm_head, saved as one file
        "mixtral": (tiny_hf_causal_lm("mixtral"), False),
        "litgpt": (_litgpt(), False),
    }
    return {name: (root / name, _trained(model, root / name, single)) for name, (model, single) in models.items()}


def _load_hf(out: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def _same_logits(exported: torch.nn.Module, trained: Wrapped) -> None:
    with torch.no_grad():
        expected = _logits(trained.model, TOKENS)
        assert (_logits(exported, TOKENS) - expected).abs().max() <= 1e-5


def test_a_sharded_checkpoint_exports_as_a_sharded_hugging_face_folder(checkpoints, tmp_path):
    path, trained = checkpoints["llama"]
    report = export_checkpoint(path, tmp_path / "out", max_shard_size="20KB")
    shards = sorted(f for f in report.files if f.endswith(".safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards and report.prefix == "model."
    assert not any(k.startswith("model.model.") for k in index["weight_map"])  # the LightningModule prefix removed
    for shard in shards:  # each at most the shard size, unless one tensor is larger
        with safe_open(tmp_path / "out" / shard, "pt") as f:
            tensors = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118 (a safetensors file, not a dict)
            assert len(tensors) == 1 or sum(t.nbytes for t in tensors) <= 20_000
    assert report.peak_tensor_bytes <= 20_000 < report.total_bytes / 3  # streamed: one shard in memory at a time
    _same_logits(_load_hf(tmp_path / "out"), trained)


def test_tied_weights_are_written_once_from_a_single_file_checkpoint(checkpoints, tmp_path):
    path, trained = checkpoints["gpt2"]
    assert path.is_file()
    report = export_checkpoint(path, tmp_path / "out")
    assert "model.safetensors" in report.files and "model.safetensors.index.json" not in report.files
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    exported = _load_hf(tmp_path / "out")
    assert exported.lm_head.weight is exported.transformer.wte.weight
    _same_logits(exported, trained)


def test_a_mixtral_exports_per_expert_as_save_pretrained_writes_and_loads_strictly(checkpoints, tmp_path):
    """The published layout by default (``block_sparse_moe.experts.N.w1``: the names and shapes ``save_pretrained``
    writes, transformers' reverse conversion), the stacked one on request; both load strictly, with the logits."""
    path, trained = checkpoints["mixtral"]
    report = export_checkpoint(path, tmp_path / "out", max_shard_size=50_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    tiny_hf_causal_lm("mixtral").save_pretrained(tmp_path / "saved", max_shard_size="50KB")  # the same config
    saved = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(saved["weight_map"])
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in index["weight_map"]
    assert index["metadata"] == saved["metadata"] == {"total_parameters": 59808, "total_size": 239232}
    assert report.total_bytes == 239232
    _same_logits(_load_hf(tmp_path / "out"), trained)
    export_checkpoint(path, tmp_path / "stacked", max_shard_size=50_000, stacked_experts=True)
    index = json.loads((tmp_path / "stacked" / "model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in index["weight_map"]
    _same_logits(_load_hf(tmp_path / "stacked"), trained)


def test_a_litgpt_gpt_exports_as_a_litgpt_folder(checkpoints, tmp_path):
    from litgpt.config import Config
    from litgpt.model import GPT

    path, trained = checkpoints["litgpt"]
    cli_main(["export", str(path), str(tmp_path / "out"), "--format", "litgpt"])
    model = GPT(Config.from_file(tmp_path / "out" / "model_config.yaml"))
    model.load_state_dict(torch.load(tmp_path / "out" / "lit_model.pth", weights_only=True), strict=True)
    _same_logits(model.eval(), trained)


def test_a_checkpoint_without_a_config_needs_one(checkpoints, tmp_path):
    path, trained = checkpoints["llama"]
    bare = tmp_path / "bare"
    checkpoint = torch.load(_single_file(path, tmp_path), weights_only=True)
    del checkpoint["lightning_dist"]["pretrained_configs"]
    torch.save(checkpoint, bare)
    with pytest.raises(CheckpointError, match="holds no config of a Hugging Face PreTrainedModel.*--config PATH"):
        export_checkpoint(bare, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    trained.model.config.save_pretrained(tmp_path / "config")  # a folder with config.json; the prefix is found
    report = export_checkpoint(bare, tmp_path / "out", config=tmp_path / "config")
    assert report.prefix == "model."
    _same_logits(_load_hf(tmp_path / "out"), trained)


def _single_file(path: Path, tmp_path: Path) -> Path:
    out = tmp_path / "consolidated.ckpt"
    cli_main(["consolidate", str(path), str(out)])
    return out


def test_an_existing_out_that_is_not_an_export_is_refused_and_left_alone(checkpoints, tmp_path):
    path, _ = checkpoints["llama"]
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    with pytest.raises(CheckpointError, match="Refusing to write .*not an export of lightning_dist"):
        export_checkpoint(path, file)
    assert file.read_text() == "mine"
    export_checkpoint(path, tmp_path / "out")
    (tmp_path / "out" / "README.md").write_text("my notes")  # a user's file beside an export's
    with pytest.raises(CheckpointError, match=r"holding files an export did not write \(README.md\)"):
        export_checkpoint(path, tmp_path / "out")
    assert (tmp_path / "out" / "README.md").read_text() == "my notes" and (tmp_path / "out" / "config.json").exists()
    with pytest.raises(CheckpointError, match="it is the checkpoint being read"):
        export_checkpoint(path, path)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


def test_an_earlier_export_is_replaced(checkpoints, tmp_path):
    path, trained = checkpoints["llama"]
    out = tmp_path / "out"
    export_checkpoint(path, out, max_shard_size="20KB")
    report = export_checkpoint(path, out)  # one file now: the shards of the first export are gone
    assert sorted(p.name for p in out.iterdir()) == sorted([*report.files, EXPORT_FOLDER_MARKER])
    assert "model.safetensors" in report.files
    _same_logits(_load_hf(out), trained)
    shutil.rmtree(out)


def test_shard_sizes_read_as_hugging_face_writes_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2**31
    assert parse_size(1234) == 1234 and parse_size("1.5kb") == 1500
    for bad in ("5 parsecs", "-1", 0, True):
        with pytest.raises(CheckpointError):
            parse_size(bad)
