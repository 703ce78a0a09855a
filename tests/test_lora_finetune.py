"""The fine-tuning loop end to end (issue 54): PEFT LoRA on a stock Llama started from a published-style folder (bf16,
3 shards, a tokenizer) with ``initial_weights`` under tensor_parallel (tp2), fsdp2 (dp2), zeropp (dp2, quantization
off), pipeline (pp2) and hybrid3d (pp2 × tp2), against one process that called ``from_pretrained`` then
``get_peft_model``; then each run's checkpoint exported as a merged Hugging Face folder, a PEFT adapter folder and in
bfloat16, loaded by transformers and PEFT themselves. The runs: ``tests/scenarios/lora_pretrained_runs.py`` (one launch of 2 processes, one of 4)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from launch import run_scenarios

from lightning_dist.checkpoint import CheckpointError
from lightning_dist.checkpoint.export import export_checkpoint

LAYOUTS = {"tp": 2, "fsdp2": 2, "zeropp": 2, "pp": 2, "hybrid": 4}
FP32_FIRST_LOSS_TOL = 1e-5  # the bar; measured below
FP64_TOL = 1e-10
STEPS, GLOBAL_BATCH = 3, 4
PROBE = (torch.arange(24).reshape(3, 8) * 7) % 64


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scenarios.models import save_litgpt_folder, save_tiny_tokenizer, tiny_hf_causal_lm

    root = tmp_path_factory.mktemp("lora_finetune")
    torch.manual_seed(0)
    tiny_hf_causal_lm("llama").to(torch.bfloat16).save_pretrained(root / "llama", max_shard_size="20KB")
    save_tiny_tokenizer(root / "llama")
    save_litgpt_folder(root / "litgpt")
    return root


def _one_process(
    folder: Path, dtype: str, steps: int, adapters: Path | None = None, litgpt: bool = False
) -> tuple[list[float], L.LightningModule]:
    """``from_pretrained`` then ``get_peft_model`` in one process (``litgpt``: litgpt's LoRA ``GPT`` and its loading),
    on the global batch of every step; ``adapters``: where to save its adapters' initial values (the runs copy
    them)."""
    from scenarios.common import SEQ_LEN, OneProcessData, StepRecorder, trainer_kwargs
    from scenarios.models import PretrainedLitLoRA, PretrainedLoraLM

    L.seed_everything(1234, verbose=False)
    data = OneProcessData(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, train_samples=64, val_samples=4)
    if litgpt:
        module = PretrainedLitLoRA(str(folder), from_pretrained=True)
    else:
        module = PretrainedLoraLM(str(folder), from_pretrained=True, dtype=dtype)
    if adapters is not None:
        torch.save({n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}, adapters)
    recorder = StepRecorder()
    precision = "64-true" if dtype == "float64" else "32-true"
    trainer = L.Trainer(**trainer_kwargs(1, strategy="auto", precision=precision, limit_val_batches=0),
                        max_steps=steps, callbacks=[recorder])  # fmt: skip
    trainer.fit(module, data)
    os.environ.pop("PL_GLOBAL_SEED", None)
    return recorder.losses, module


@pytest.fixture(scope="module")
def references(workdir: Path) -> dict:
    fp32, _ = _one_process(workdir / "llama", "float32", 1)
    fp64, trained = _one_process(workdir / "llama", "float64", STEPS, workdir / "llama_adapters.pt")
    lit, lit_trained = _one_process(workdir / "litgpt", "float64", STEPS, workdir / "litgpt_adapters.pt", litgpt=True)
    with torch.no_grad():
        lit_logits = lit_trained.model.eval()(PROBE)
    return {"fp32": fp32, "fp64": fp64, "probe_loss": _probe_loss(trained.model.eval()), "litgpt": lit,
            "litgpt_logits": lit_logits}  # fmt: skip


@pytest.fixture(scope="module")
def runs(workdir: Path, references: dict) -> dict:
    two = [f"{layout}_{p}" for layout in ("tp", "fsdp2", "zeropp", "pp") for p in ("fp32", "fp64")]
    two.append("litgpt_fsdp2_fp64")
    found = run_scenarios("lora_pretrained_runs.py", 2, workdir, two, timeout=900)
    found.update(run_scenarios("lora_pretrained_runs.py", 4, workdir, ["hybrid_fp32", "hybrid_fp64"], timeout=900))
    return found


def _probe_loss(model: torch.nn.Module) -> float:
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits.to(torch.float64)
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), PROBE[:, 1:].flatten()))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_from_initial_weights_starts_from_the_pretrained_model_and_trains_as_one_process(runs, references, layout):
    fp32, fp64 = runs[f"{layout}_fp32"], runs[f"{layout}_fp64"]
    # lora_B is zero, so the first loss is the pretrained model's: measured 0 to 4.8e-7 in fp32 (fp64 after: ≤ 8.9e-16)
    assert abs(fp32["losses"][0] - references["fp32"][0]) <= FP32_FIRST_LOSS_TOL, (fp32["losses"], references["fp32"])
    assert fp64["adapters_set"] > 0
    assert len(fp64["losses"]) == STEPS
    gap = max(abs(a - b) for a, b in zip(fp64["losses"], references["fp64"]))
    assert gap <= FP64_TOL, (fp64["losses"], references["fp64"])
    loaded, kept = [line for line in fp64["log"] if ": initial_weights: " in line]
    assert "loaded into model.base_model.model" in loaded
    assert "8 LoRA adapter tensors keep their own initialization (lora_B zero" in kept, kept
    assert "q_proj.lora_A.default.weight" in kept


def _load_merged(folder: Path, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    assert not any(info.values()), info  # strict: nothing missing, unexpected or mismatched
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_checkpoint_exports_a_merged_model_and_an_adapter_that_give_the_trained_loss(
    runs, references, workdir, layout, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = runs[f"{layout}_fp64"]["checkpoint"]
    report = export_checkpoint(checkpoint, tmp_path / "hf", format="hf")
    assert report.merged == 4 and "initial_weights folder" in report.tokenizer
    # the bar is 1e-4 (fp32); fp64 here, measured ≤ 1e-12
    assert abs(_probe_loss(_load_merged(tmp_path / "hf")) - references["probe_loss"]) <= 1e-9

    export_checkpoint(checkpoint, tmp_path / "peft", format="peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(workdir / "llama") and config["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(workdir / "llama", dtype=torch.float64)
    adapted = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    assert abs(_probe_loss(adapted) - references["probe_loss"]) <= 1e-9
    merged = adapted.merge_and_unload()  # PEFT's own merge equals the export's
    exported = _load_merged(tmp_path / "hf").state_dict()
    assert all(torch.allclose(v, exported[k], rtol=0, atol=1e-12) for k, v in merged.state_dict().items())

    sizes = {}
    for dtype in ("bfloat16", "float32"):
        out = tmp_path / dtype
        sizes[dtype] = export_checkpoint(checkpoint, out, format="hf", dtype=dtype).total_bytes
        assert json.loads((out / "config.json").read_text())["dtype"] == dtype
        from safetensors import safe_open

        for file in out.glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                kinds = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
            assert kinds == {"BF16" if dtype == "bfloat16" else "F32"}
    assert sizes["bfloat16"] * 2 == sizes["float32"]
    bf16 = _load_merged(tmp_path / "bfloat16", torch.bfloat16)
    assert abs(_probe_loss(bf16) - references["probe_loss"]) <= 0.05  # bf16 weights: 8 bits of mantissa

    source, exported_tokenizer = (
        AutoTokenizer.from_pretrained(workdir / "llama"),
        AutoTokenizer.from_pretrained(tmp_path / "hf"),
    )
    text = "a b c 7 z q"
    assert exported_tokenizer(text)["input_ids"] == source(text)["input_ids"]
    chat = [{"role": "user", "content": "a b"}]
    assert exported_tokenizer.apply_chat_template(chat, tokenize=False) == source.apply_chat_template(
        chat, tokenize=False
    )
    assert AutoTokenizer.from_pretrained(tmp_path / "peft")(text)["input_ids"] == source(text)["input_ids"]


@pytest.mark.slow
def test_export_at_fit_end_writes_the_folder_the_offline_export_writes(runs, workdir, tmp_path):
    """fsdp2 (2 ranks) with ``ExportAtFitEnd``: the folder equals ``export`` of the checkpoint saved after the same fit,
    tensor by tensor, with the same files."""
    from safetensors.torch import load_file

    run = runs["fsdp2_fp64"]
    offline = tmp_path / "offline"
    export_checkpoint(run["checkpoint"], offline, format="hf")
    at_end = workdir / "at_fit_end"
    assert sorted(p.name for p in at_end.iterdir()) == sorted(p.name for p in offline.iterdir())
    mine, theirs = load_file(at_end / "model.safetensors"), load_file(offline / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert run["at_fit_end"]["seconds"] > 0 and run["at_fit_end"]["peak_bytes"] > 0
    assert not [p.name for p in workdir.iterdir() if p.name.startswith(".at_fit_end")]  # its temporary checkpoint


@pytest.mark.slow
def test_lora_exports_refuse_a_base_without_config_and_an_adapter_over_a_model(runs, tmp_path):
    from lightning_dist.cli import main as cli_main

    checkpoint = runs["fsdp2_fp64"]["checkpoint"]
    single = tmp_path / "single.ckpt"
    cli_main(["consolidate", checkpoint, str(single)])
    state = torch.load(single, weights_only=True)
    records = state["lightning_dist"]["pretrained_configs"]
    state["lightning_dist"]["pretrained_configs"] = [r for r in records if r["format"] != "hf"]  # the base's config
    torch.save(state, tmp_path / "no_config.ckpt")
    with pytest.raises(CheckpointError, match="holds no config of a Hugging Face PreTrainedModel.*--config PATH"):
        export_checkpoint(tmp_path / "no_config.ckpt", tmp_path / "out", format="hf")
    with pytest.raises(FileNotFoundError, match="--tokenizer '.*/nowhere': no such folder"):
        export_checkpoint(checkpoint, tmp_path / "out", format="hf", tokenizer=tmp_path / "nowhere")
    assert not (tmp_path / "out").exists()
    export_checkpoint(checkpoint, tmp_path / "model", format="hf")
    before = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()}
    with pytest.raises(CheckpointError, match=r"an export of another format \(a Hugging Face model folder"):
        export_checkpoint(checkpoint, tmp_path / "model", format="peft")
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()} == before


@pytest.mark.slow
def test_litgpt_lora_from_a_litgpt_folder_trains_as_one_process_and_exports_merged(runs, references, tmp_path):
    """litgpt's LoRA ``GPT`` under fsdp2 (dp2) from ``lit_model.pth``: the base weights read under ``linear.``, the
    adapters kept (then set to the reference's), the losses of litgpt's own loading; ``--format litgpt`` writes the
    plain ``GPT`` merged by litgpt, which loads strictly and gives the trained model's logits."""
    from litgpt.config import Config
    from litgpt.model import GPT

    run = runs["litgpt_fsdp2_fp64"]
    gap = max(abs(a - b) for a, b in zip(run["losses"], references["litgpt"], strict=True))
    assert gap <= FP64_TOL, (run["losses"], references["litgpt"])
    assert any("4 LoRA adapter tensors keep their own initialization" in line for line in run["log"]), run["log"]
    export_checkpoint(run["checkpoint"], tmp_path / "lit", format="litgpt")
    model = GPT(Config.from_file(tmp_path / "lit" / "model_config.yaml")).to(torch.float64)
    model.load_state_dict(torch.load(tmp_path / "lit" / "lit_model.pth", weights_only=True), strict=True)
    with torch.no_grad():
        assert (model.eval()(PROBE) - references["litgpt_logits"]).abs().max() <= 1e-9


@pytest.mark.slow
def test_the_lora_yaml_trains_from_a_published_folder_to_a_folder_a_server_loads(workdir, tmp_path):
    """``configs/finetune_lora.yaml`` as a user runs it (``lightning-dist fit --config``, 2 processes), pointed at the
    published-style folder: the run ends with a merged bf16 folder, with the tokenizer, that loads strictly."""
    import subprocess
    import sys

    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo = Path(__file__).resolve().parents[1]
    config = yaml.safe_load((repo / "configs" / "finetune_lora.yaml").read_text())
    config["trainer"].update({"max_steps": 2, "default_root_dir": str(tmp_path)})
    config["trainer"]["strategy"]["init_args"]["initial_weights"] = str(workdir / "llama")
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "served")
    config["model"]["init_args"]["folder"] = str(workdir / "llama")
    config["data"]["init_args"].update({"seq_len": 16, "vocab_size": 64, "samples": 16})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "lightning_dist.cli", "fit", "--config", str(tmp_path / "run.yaml")]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ExportAtFitEnd: wrote" in done.stdout + done.stderr
    # rank 0 shows the bytes it reads, a plain line per update into a pipe (the Trainer's progress bar is on)
    assert re.search(r"^initial_weights: [\d.]+ MiB of [\d.]+ MiB \(100%\), \d+ s$", done.stderr, re.MULTILINE)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "served", output_loading_info=True)
    assert not any(info.values()) and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    text = "a b 7"
    assert AutoTokenizer.from_pretrained(tmp_path / "served")(text) == AutoTokenizer.from_pretrained(workdir / "llama")(
        text
    )


def test_adapters_fully_sharded_one_by_one_keep_peft_init(tmp_path):
    """A one-layer Llama under fsdp2: no repeated block, so the plan shards every leaf, LoRA's ``lora_A`` and
    ``lora_B`` too, whose classes FSDP2 swaps (``FSDPLinear``). They are still recognized: ``lora_B`` is zero after
    materializing and the first loss is the pretrained model's (one process, fp32)."""
    import transformers

    from benchmarks.common import save_published_folder
    from examples.lora import LoraFineTune
    from lightning_dist import FSDP2Strategy

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    save_published_folder(transformers.LlamaForCausalLM(config), tmp_path / "one_layer")
    folder = str(tmp_path / "one_layer")
    batch = {"input_ids": PROBE[:, :-1], "labels": PROBE[:, 1:]}

    class FirstLoss(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.loss = float(outputs["loss"])
            self.lora_b = [float(p.full_tensor().abs().max()) for n, p in pl_module.named_parameters() if "lora_B" in n]

    first = FirstLoss()
    trainer = L.Trainer(strategy=FSDP2Strategy(initial_weights=folder), accelerator="cpu", devices=1, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=[first])  # fmt: skip
    with trainer.init_module(empty_init=True):
        module = LoraFineTune(folder, r=4, lr=0.0)
    trainer.fit(module, torch.utils.data.DataLoader([batch], batch_size=None))
    reference = LoraFineTune(folder, r=4, from_pretrained=True)
    assert first.lora_b == [0.0, 0.0]
    assert abs(first.loss - float(reference.training_step(batch, 0))) <= 1e-6
