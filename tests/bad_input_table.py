"""The table of bad inputs: each mistake a user can make, where it is caught, and what they are told.

``tests/test_bad_inputs.py`` runs every row; the "Common errors" section of ``docs/errors.md`` is generated from it,
with the messages the rows really produce:

    python tests/bad_input_table.py --write-docs

Rows marked ``before launch`` run in the calling process with process creation forbidden, so a check that only
happens after launch cannot pass for one that happens before. Damaged checkpoints are a table of their own
(``tests/test_checkpoint_integrity.py``: every case against resume, ``inspect`` and ``consolidate``); the docs list
them from there.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable
from contextlib import redirect_stderr
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from examples.gpt import GPT
from lightning_dist import (
    AsyncDistributedCheckpointIO,
    CheckpointError,
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
)
from lightning_dist import fabric as fabric_strategies
from lightning_dist.parallel.pipeline import StageCutError

CONSTRUCTION = "construction"
BEFORE_LAUNCH = "before launch"


@dataclass(frozen=True)
class BadInput:
    """One mistake: ``attempt(tmp_path)`` makes it; it must raise ``error`` whose text matches ``message``."""

    mistake: str  # what the user did, as docs/errors.md lists it
    attempt: Callable[[Path], Any]
    error: type[BaseException]
    message: str  # a regex over the error's text (stderr included for CLI exits)
    caught: str = BEFORE_LAUNCH  # CONSTRUCTION: by the constructor; BEFORE_LAUNCH: by the entry point, no rank started


def _gpt(**kwargs: Any) -> GPT:
    return GPT(**{"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4, **kwargs})


def _without_ft_environment(build: Callable[[], Any]) -> Any:
    """``build()`` with none of the fault-tolerance variables set in the environment."""
    from lightning_dist.parallel.fault_tolerance import LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS_ENV, REPLICA_GROUP_ID_ENV

    saved = {name: os.environ.pop(name) for name in (LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS_ENV, REPLICA_GROUP_ID_ENV)
             if name in os.environ}  # fmt: skip
    try:
        return build()
    finally:
        os.environ.update(saved)


def _fit(
    strategy: Any, model: Any = None, devices: int = 2, ckpt_path: Path | None = None, **trainer_kwargs: Any
) -> None:
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, logger=False, max_steps=1, **trainer_kwargs
    )
    trainer.fit(model if model is not None else _gpt(), ckpt_path=ckpt_path)


def _cli(tmp_path: Path, *flags: str, **overrides: Any) -> None:
    """``lightning-dist fit --config`` with configs/fsdp2.yaml changed by ``overrides`` (dotted keys), and
    ``flags`` after it (``--print_config``)."""
    from lightning_dist.cli import main

    config = yaml.safe_load((REPO_ROOT / "configs" / "fsdp2.yaml").read_text())
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(path), f"--trainer.default_root_dir={tmp_path}", *flags])


class _HFCausalLM(LightningModule):
    """A plain LightningModule around a Hugging Face causal LM, as users write one."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters())


def _llama(kv_heads: int) -> _HFCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=kv_heads, max_position_embeddings=32,
    )  # fmt: skip
    return _HFCausalLM(LlamaForCausalLM(config))


def _qwen3(kv_heads: int) -> _HFCausalLM:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=32,
    )  # fmt: skip
    return _HFCausalLM(Qwen3ForCausalLM(config))


def _lora_llama(targets: list[str]) -> _HFCausalLM:
    """A Llama fine-tuned with PEFT's LoRA on ``targets``, wrapped by ``get_peft_model`` as users write it."""
    from peft import LoraConfig, get_peft_model

    return _HFCausalLM(get_peft_model(_llama(2).model, LoraConfig(r=8, target_modules=targets)))


def _peft_from_initial_weights(config: str) -> Callable[[Path], None]:
    """A fit whose module wraps the Llama with PEFT's ``config`` (``dora``: LoRA with ``use_dora=True``; ``ia3``;
    ``pissa``: LoRA initialized from the base weights) and whose strategy reads ``initial_weights``."""

    def attempt(tmp_path: Path) -> None:
        from peft import IA3Config, LoraConfig, get_peft_model

        model = _llama(2).model
        model.save_pretrained(tmp_path / "llama")
        peft_config = {
            "dora": lambda: LoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
            "ia3": lambda: IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
            "pissa": lambda: LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa"),
        }[config]()
        _fit(FSDP2Strategy(initial_weights=str(tmp_path / "llama")), _HFCausalLM(get_peft_model(model, peft_config)))

    return attempt


def _router_loss_without_experts() -> _HFCausalLM:
    """A Llama whose config asks for the router's auxiliary loss (a flag copied from a MoE config): no experts."""
    model = _llama(2)
    model.model.config.output_router_logits = True
    return model


def _mixtral(num_experts: int = 4, **config_kwargs: Any) -> _HFCausalLM:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=num_experts, num_experts_per_tok=2, max_position_embeddings=32,
        **config_kwargs,
    )  # fmt: skip
    return _HFCausalLM(MixtralForCausalLM(config))


class _Pooling(LightningModule):
    """A model of sets of points (mean-pooled) or feature vectors: not a sequence model."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).flatten(1).mean(1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _HFBatchModule(LightningModule):
    """A LightningModule passing each batch (a dict) to a Hugging Face model: ``self.model(**batch).loss``."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _vit_classifier() -> _HFBatchModule:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=32, num_labels=3)  # fmt: skip
    return _HFBatchModule(ViTForImageClassification(config))


def _t5() -> _HFBatchModule:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
                      decoder_start_token_id=0)  # fmt: skip
    return _HFBatchModule(T5ForConditionalGeneration(config))


def _images(n: int = 8) -> list[dict[str, torch.Tensor]]:
    return [{"pixel_values": torch.randn(3, 32, 32), "labels": torch.tensor(i % 3)} for i in range(n)]


def _tokens(length: int = 8, n: int = 8) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.randint(0, 64, (length,)), "labels": torch.randint(0, 64, (length,))} for _ in range(n)]


def _fit_leaving_nothing(tmp_path: Path, strategy: Any, model: Any, samples: list[Any]) -> None:
    """``fit`` on ``samples`` (4 to a batch) with Lightning's default logger and checkpointing under ``tmp_path``;
    a refused run must leave nothing there (no ``lightning_logs/version_N``)."""
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1, default_root_dir=tmp_path,
                      enable_progress_bar=False)  # fmt: skip
    try:
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(samples, batch_size=4))
    finally:
        left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
        if left:
            raise AssertionError(f"the refused run left {left} behind")


def _manual_optimization(model: LightningModule) -> LightningModule:
    model.automatic_optimization = False  # a module that calls manual_backward() and optimizer.step() itself
    return model


class _RotaryTable(torch.nn.Module):
    """Rotary frequencies computed in the constructor into a non-persistent buffer, with no ``reset_parameters``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)


def _meta_model_with_constructor_buffer() -> None:
    """A model built under ``trainer.init_module(empty_init=True)`` whose non-persistent buffer nothing can set."""
    trainer = Trainer(strategy="fsdp2", accelerator="cpu", devices=2, logger=False, max_steps=1)
    with trainer.init_module(empty_init=True):
        model = _gpt()
        model.rotary = _RotaryTable()
    trainer.fit(model)


def _unfinished(tmp_path: Path) -> Path:
    path = tmp_path / "step=3.ckpt"
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"\0" * 8)
    return path


def _crafted_index(tmp_path: Path) -> Path:
    from scenarios.crafted_checkpoints import Payload, sharded_with_index  # type: ignore[import-not-found]

    return sharded_with_index(tmp_path / "downloaded.ckpt", Payload(tmp_path / "PAYLOAD_RAN"))


def _escaping(kind: str) -> Callable[[Path], Path]:
    """A checkpoint crafted to read a file outside its folder (``scenarios.crafted_checkpoints.ESCAPING``)."""

    def build(tmp_path: Path) -> Path:
        from scenarios.crafted_checkpoints import ESCAPING  # type: ignore[import-not-found]

        return ESCAPING[kind][0](tmp_path / "downloaded.ckpt")

    return build


def _damaged_safetensors(damage: str) -> Callable[[Path], None]:
    """A fit whose ``initial_weights`` is a safetensors file (of two tensors, ``a`` and ``b``) damaged by ``damage``."""

    def attempt(tmp_path: Path) -> None:
        import json
        import struct

        from safetensors.torch import save_file

        path = tmp_path / "model.safetensors"
        save_file({"a": torch.ones(4, 4), "b": torch.zeros(3)}, path)
        raw = path.read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
        if damage == "cut short":
            data = data[:-10]
        elif damage == "overlap":
            header["b"]["data_offsets"] = [0, 12]
        elif damage == "past the end":
            header["b"]["data_offsets"] = [64, 1000]
        elif damage == "dtype":
            header["b"]["dtype"] = "F64"
        elif damage == "no shape":
            del header["b"]["shape"]
        elif damage == "list":
            header = [header["a"], header["b"]]
        elif damage == "folder":
            path.unlink()
            path.mkdir()
        if damage != "folder":
            encoded = json.dumps(header).encode()
            path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
        _fit(FSDP2Strategy(initial_weights=str(tmp_path)))

    return attempt


_DAMAGED_FILE = r"Pretrained weights: '<dir>/model.safetensors' is not a readable safetensors file: "


ROWS: list[BadInput] = [
    # --- option types and values, from Python
    BadInput("A size given as a string in Python", lambda t: _fit(FSDP2Strategy(data_parallel_shard_size="2")),
             ValueError, r"data_parallel_shard_size='2' is not a valid size \(a str: write 2, not '2'\)\. Pass a positive int"),
    BadInput("A size of zero", lambda t: _fit(TensorParallelStrategy(tensor_parallel_size=0)),
             ValueError, r"tensor_parallel_size=0 is not a valid size\. Pass a positive int, or 'auto'"),
    BadInput("A negative size", lambda t: _fit(PipelineStrategy(pipeline_parallel_size=-2)),
             ValueError, r"pipeline_parallel_size=-2 is not a valid size\. Pass a positive int"),
    BadInput("A float size", lambda t: _fit(ContextParallelStrategy(context_parallel_size=2.0)),
             ValueError, r"context_parallel_size=2\.0 is not a valid size"),
    BadInput("A string where a bool is expected", lambda t: FSDP2Strategy(activation_checkpointing="no"),
             TypeError, r"activation_checkpointing='no' must be True or False", CONSTRUCTION),
    BadInput("A misspelt option in Python", lambda t: FSDP2Strategy(reshard_after_forwad=True),
             TypeError, r"FSDP2Strategy has no option 'reshard_after_forwad' \(did you mean 'reshard_after_forward'\?\)", CONSTRUCTION),
    BadInput("An option of another strategy", lambda t: TensorParallelStrategy(context_parallel_size=2),
             TypeError, r"TensorParallelStrategy has no option 'context_parallel_size' \(did you mean 'tensor_parallel_size'\?\)\. Its options are: tensor_parallel_size", CONSTRUCTION),
    BadInput("An unknown FSDP sharding mode", lambda t: FSDP2Strategy(sharding="zero3"),
             ValueError, r"sharding='zero3' is not one of \['full'", CONSTRUCTION),
    BadInput("A wrap regex that does not compile", lambda t: FSDP2Strategy(wrap_regex="blocks.("),
             ValueError, r"wrap_regex='blocks\.\(' is not a valid regular expression", CONSTRUCTION),
    BadInput("reshard_after_forward=1", lambda t: FSDP2Strategy(reshard_after_forward=1),
             ValueError, r"reshard_after_forward=1: an int must be a group size of at least 2", CONSTRUCTION),
    BadInput("cpu_offload without sharding", lambda t: FSDP2Strategy(sharding="no_shard", cpu_offload=True),
             ValueError, r"cpu_offload needs sharded parameters; it cannot be combined with sharding='no_shard'", CONSTRUCTION),
    BadInput("cpu_offload on the CPU accelerator", lambda t: _fit("fsdp2_cpu_offload"),
             ValueError, r"cpu_offload=True .* already uses the CPU accelerator"),
    BadInput("A ZeRO++ option that FSDP2 owns", lambda t: ZeroPPStrategy(reshard_after_forward=2),
             TypeError, r"ZeroPPStrategy sets reshard_after_forward itself .* Remove the option, or use FSDP2Strategy", CONSTRUCTION),
    BadInput("An unknown pipeline schedule", lambda t: PipelineStrategy(schedule="1f2b"),
             ValueError, r"schedule='1f2b' is not a pipeline schedule; choose one of \['1f1b'", CONSTRUCTION),
    BadInput("Zero micro-batches", lambda t: PipelineStrategy(n_microbatches=0),
             ValueError, r"n_microbatches must be a positive int, got 0", CONSTRUCTION),
    BadInput("An unknown context-parallel attention", lambda t: ContextParallelStrategy(attention="flash"),
             ValueError, r"attention='flash' is not one of \['ring', 'allgather', 'ulysses'\]", CONSTRUCTION),
    BadInput("An unknown load-balancing layout", lambda t: ContextParallelStrategy(load_balance="random"),
             ValueError, r"load_balance='random' is not one of \['zigzag', 'contiguous'\]", CONSTRUCTION),
    BadInput("A malformed sequence_keys entry", lambda t: ContextParallelStrategy(sequence_keys=["tokens:x"]),
             ValueError, r"sequence_keys entry 'tokens:x': write 'name' or 'name:dim'", CONSTRUCTION),
    BadInput("A TP plan entry with an unknown layout",
             lambda t: TensorParallelStrategy(plan={"blocks.*.mlp.up": {"style": "colwise", "output_layouts": "shard(x)"}}),
             ValueError, r"plan\['blocks\.\*\.mlp\.up'\]: Unknown layout 'shard\(x\)'", CONSTRUCTION),
    # --- from YAML (lightning-dist fit --config)
    BadInput("A string where an int is expected, in YAML",
             lambda t: _cli(t, **{"trainer.strategy": {"class_path": "lightning_dist.FSDP2Strategy", "init_args": {"data_parallel_shard_size": "two"}}}),
             SystemExit, r"data_parallel_shard_size.*'two'"),
    BadInput("A misspelt option in YAML",
             lambda t: _cli(t, **{"trainer.strategy": {"class_path": "lightning_dist.FSDP2Strategy", "init_args": {"reshard_after_forwad": True}}}),
             SystemExit, r"reshard_after_forwad"),
    BadInput("An option value the strategy refuses, in YAML",
             lambda t: _cli(t, **{"trainer.strategy": {"class_path": "lightning_dist.ZeroPPStrategy", "init_args": {"hpz_partition_size": 1}}}),
             SystemExit, r"^trainer\.strategy: hpz_partition_size=1 must be 'auto' \(ranks per node\), an int >= 2, or None"),
    BadInput("An option value the strategy refuses, in YAML, with --print_config",
             lambda t: _cli(t, "--print_config", **{"trainer.strategy": {"class_path": "lightning_dist.ZeroPPStrategy", "init_args": {"hpz_partition_size": 1}}}),
             SystemExit, r"^trainer\.strategy: hpz_partition_size=1 must be 'auto' \(ranks per node\), an int >= 2, or None"),
    BadInput("An unknown strategy name", lambda t: _cli(t, **{"trainer.strategy": "fsdp3"}),
             SystemExit, r"strategy='fsdp3' is not a registered strategy name\. Did you mean 'fsdp2'\? lightning_dist registers: fsdp2, "),
    BadInput("Transformer Engine precision", lambda t: _cli(t, **{"trainer.precision": "transformer-engine"}),
             SystemExit, r"trainer\.precision: .*transformer-engine.*Supported: "),
    # --- the mesh against the processes
    BadInput("Sizes that multiply to more than devices × num_nodes", lambda t: _fit(TensorParallelStrategy(tensor_parallel_size=4)),
             ValueError, r"data_parallel_shard_size=1, tensor_parallel_size=4 make a mesh of 4 ranks, but 2 processes are running .* Make the sizes multiply to 2"),
    BadInput("Sizes that do not divide the processes", lambda t: _fit(FSDP2Strategy(data_parallel_replicate_size=3), devices=4),
             ValueError, r"Cannot fit data_parallel_replicate_size=3 into 4 processes: 4 is not divisible by 3"),
    BadInput("num_nodes left out of the mesh", lambda t: _fit(TensorParallelStrategy(tensor_parallel_size=2), num_nodes=2),
             ValueError, r"make a mesh of 2 ranks, but 4 processes are running \(devices × num_nodes\)"),
    BadInput("A pipeline of one stage", lambda t: _fit(PipelineStrategy(pipeline_parallel_size=1, data_parallel_shard_size=2)),
             ValueError, r"pipeline_parallel_size=1: pipeline parallelism needs at least 2 ranks"),
    BadInput("An hpZ group that does not divide the sharding group", lambda t: _fit(ZeroPPStrategy(hpz_partition_size=3)),
             ValueError, r"hpz_partition_size=3 must divide the sharding group size 2"),
    # --- the model against the mesh
    BadInput("Attention heads not divisible by tp", lambda t: _fit(TensorParallelStrategy(tensor_parallel_size=2), _gpt(d_model=48, n_head=3)),
             ValueError, r"(?s)Cannot shard the model over tensor_parallel_size=2.*= 3 is"),
    BadInput("KV heads that neither divide nor are divided by tp", lambda t: _fit(TensorParallelStrategy(tensor_parallel_size=2), _llama(3)),
             ValueError, r"(?s)tensor_parallel_size=2.*key/value heads"),
    BadInput("Per-head q/k norms (Qwen3) with tp above the KV heads", lambda t: _fit(TensorParallelStrategy(tensor_parallel_size=2), _qwen3(1)),
             ValueError, r"(?s)q_norm.weight: a per-head norm in an attention module with 1 key/value heads; with tp=2, 2 ranks hold each"),
    BadInput("A LoRA-wrapped output head under sequence_parallel", lambda t: _fit(TensorParallelStrategy(tensor_parallel_size=2, sequence_parallel=True), _lora_llama(["q_proj", "lm_head"])),
             ValueError, r"(?s)base_model\.model\.lm_head: a PEFT adapter layer outside the attention and MLP modules the plan shards.*with sequence_parallel it would see only this rank's slice of the sequence"),
    BadInput("A vocabulary not divisible by tp", lambda t: _fit(TensorParallelStrategy(tensor_parallel_size=2), _gpt(vocab_size=63)),
             ValueError, r"(?s)tok_emb: vocabulary.* = 63 is not divisible.*pad the"),
    BadInput("Heads not divisible by cp under Ulysses", lambda t: _fit(ContextParallelStrategy(attention="ulysses"), _gpt(d_model=24, n_head=3)),
             ValueError, r"attention='ulysses' splits heads over cp=2, but blocks\.0\.attn has 3 heads\. Use attention='ring'"),
    BadInput("Sets of points (not token sequences) under context_parallel", lambda t: _fit_leaving_nothing(t, "context_parallel", _Pooling(4), [(torch.randn(16, 4), torch.tensor(0.0))] * 8),
             ValueError, r"(?s)Context parallel splits token sequences over ranks, but this batch holds none.*0: \(4, 16, 4\) float32.*strategy='fsdp2'.*sequence_keys"),
    BadInput("Feature vectors under context_parallel", lambda t: _fit_leaving_nothing(t, "context_parallel", _Pooling(16), [(torch.randn(16), torch.tensor(0.0))] * 8),
             ValueError, r"(?s)this batch holds none.*0: \(4, 16\) float32.*strategy='fsdp2'"),
    BadInput("Images (ViT pixel_values) under context_parallel", lambda t: _fit_leaving_nothing(t, "context_parallel", _vit_classifier(), _images()),
             ValueError, r"(?s)this batch holds none.*pixel_values: \(4, 3, 32, 32\) float32, labels: \(4,\) int64.*Images.*strategy='fsdp2'"),
    BadInput("A constructor-computed non-persistent buffer under init_module(empty_init=True)",
             lambda t: _meta_model_with_constructor_buffer(),
             RuntimeError, r"built rotary\.inv_freq \(_RotaryTable\) on the meta device.*non-persistent buffers.*Give _RotaryTable a reset_parameters\(\)"),
    BadInput("A wrap class the model does not have", lambda t: _fit(FSDP2Strategy(wrap_modules=["DecoderLayer"])),
             ValueError, r"Cannot shard \['DecoderLayer'\]: the model has no module of that class"),
    BadInput("A wrap regex that matches no module", lambda t: _fit(FSDP2Strategy(wrap_regex=r"layers\.\d+")),
             ValueError, r"The regex 'layers\\\\\.\\\\d\+' matches no module name"),
    # --- the model and the first batch against the pipeline (refused with Lightning's default logger: no directory left)
    BadInput("A module read across pipeline stages (transformers ViT reads its patch embedding's dtype)",
             lambda t: _fit_leaving_nothing(t, PipelineStrategy(pipeline_parallel_size=2), _vit_classifier(), _images()),
             StageCutError, r"(?s)Pipeline stage 1 .*reads vit\.embeddings\.patch_embeddings, which lives on pipeline stage 0.*another parallelism.*Found before launch.*modeling_vit\.py:\d+"),
    BadInput("Manual optimization (automatic_optimization=False) under pipeline",
             lambda t: _fit(PipelineStrategy(pipeline_parallel_size=2), _manual_optimization(_gpt())),
             ValueError, r"GPT sets automatic_optimization=False \(manual optimization\), which PipelineStrategy cannot run with pipeline_parallel_size=2.*Return the loss from training_step"),
    BadInput("A 1-block model under pipeline_parallel_size=2",
             lambda t: _fit_leaving_nothing(t, PipelineStrategy(pipeline_parallel_size=2), _gpt(n_layer=1), _tokens()),
             ValueError, r"The model has 1 block \(blocks\.0\) for 2 pipeline stages.*Use fewer stages"),
    BadInput("An encoder–decoder model (T5) under pipeline",
             lambda t: _fit_leaving_nothing(t, PipelineStrategy(pipeline_parallel_size=2), _t5(), _tokens()),
             ValueError, r"T5ForConditionalGeneration is an encoder–decoder model .*: encoder–decoder models are not supported under pipeline.*Use fsdp2"),
    BadInput("An encoder–decoder model (T5) under pipeline with a hand split",
             lambda t: _fit_leaving_nothing(t, PipelineStrategy(pipeline_parallel_size=2, split=["decoder.block.0"]), _t5(), _tokens()),
             ValueError, r"encoder–decoder models are not supported under pipeline"),
    BadInput("n_microbatches that does not divide the batch",
             lambda t: _fit_leaving_nothing(t, PipelineStrategy(pipeline_parallel_size=2, n_microbatches=3), _gpt(), _tokens()),
             ValueError, r"The per-replica batch size 4 is not divisible by n_microbatches=3\. Choose n_microbatches from \[1, 2, 4\]"),
    BadInput("A sequence length not divisible by 2·cp",
             lambda t: _fit_leaving_nothing(t, ContextParallelStrategy(), _gpt(), _tokens(length=6)),
             ValueError, r"(?s)'input_ids' \(sequence length 6\).*divisible by 2·cp = 4"),
    # --- expert parallelism
    BadInput("expert_dispatch_chunks that is not a positive int", lambda t: FSDP2Strategy(expert_dispatch_chunks=0),
             ValueError, r"expert_dispatch_chunks=0 is not a positive int: the number of chunks", CONSTRUCTION),
    BadInput("expert_parallel_size that does not divide the experts",
             lambda t: _fit(FSDP2Strategy(expert_parallel_size=4), _mixtral(num_experts=6), devices=4),
             ValueError, r"expert_parallel_size=4 does not divide the 6 experts of model\.model\.layers\.0\.mlp\.experts.*\(1, 2, 3, 6\)"),
    BadInput("expert_parallel_size that does not divide dp_shard × cp",
             lambda t: _fit(FSDP2Strategy(expert_parallel_size=4, data_parallel_shard_size=2, data_parallel_replicate_size=2,
                                          sharding="hybrid"), _mixtral(), devices=4),
             ValueError, r"expert_parallel_size=4 must divide dp_shard × cp = 2 × 1 = 2.*among \[1, 2\]"),
    BadInput("Expert parallelism on a dense model", lambda t: _fit("expert_parallel", _llama(kv_heads=2)),
             ValueError, r"_HFCausalLM has no mixture-of-experts layer.*found neither \(a dense model\).*use plain fsdp2 for a dense one"),
    BadInput("expert_parallel_size under hybrid3d that does not divide dp_shard × cp",
             lambda t: _fit(Hybrid3DStrategy(expert_parallel_size=4, tensor_parallel_size=2), _mixtral(), devices=4),
             ValueError, r"expert_parallel_size=4 must divide dp_shard × cp = 2 × 1 = 2.*among \[1, 2\]"),
    BadInput("Expert parallelism on a dense model under hybrid3d (pipeline stages)",
             lambda t: _fit(Hybrid3DStrategy(expert_parallel_size=2, pipeline_parallel_size=2), _llama(kv_heads=2), devices=4),
             ValueError, r"_HFCausalLM has no mixture-of-experts layer.*found neither \(a dense model\)"),
    BadInput("expert_parallel_size with sequence_parallel over tp",
             lambda t: _fit(Hybrid3DStrategy(expert_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True),
                            _mixtral(), devices=4),
             ValueError, r"expert_parallel_size=2 with sequence_parallel=True over tp=2: the experts are replicated over tp"),
    BadInput("The router's auxiliary loss under pipeline stages, experts not found",
             lambda t: _fit("pipeline", _router_loss_without_experts()),
             ValueError, r"computes the router's auxiliary loss \(output_router_logits=True\).*found them incomplete here.*Set output_router_logits=False"),
    BadInput("expert_parallel_size under a strategy that cannot carry it",
             lambda t: TensorParallelStrategy(expert_parallel_size=2),
             TypeError, r"TensorParallelStrategy has no option 'expert_parallel_size'.*carried by fsdp2 \(and the expert_parallel strategy name\) and hybrid3d only", CONSTRUCTION),
    # --- fault tolerance (torchft replica groups)
    BadInput("fault_tolerance with a replica_group_id outside num_replica_groups",
             lambda t: FSDP2Strategy(fault_tolerance={"replica_group_id": 2, "num_replica_groups": 2, "lighthouse": "http://localhost:29510"}),
             ValueError, r"replica_group_id=2 is outside num_replica_groups=2: give each group's job an id in 0\.\.1", CONSTRUCTION),
    BadInput("fault_tolerance without the number of replica groups",
             lambda t: _without_ft_environment(lambda: FSDP2Strategy(fault_tolerance={"replica_group_id": 0, "lighthouse": "http://localhost:29510"})),
             ValueError, r"num_replica_groups is not set.*LIGHTNING_DIST_NUM_REPLICA_GROUPS", CONSTRUCTION),
    BadInput("fault_tolerance on tensor_parallel alone",
             lambda t: TensorParallelStrategy(fault_tolerance=True),
             TypeError, r"TensorParallelStrategy has no option 'fault_tolerance'.*no data-parallel replicate axis.*Hybrid3DStrategy\(fault_tolerance=", CONSTRUCTION),
    BadInput("fault_tolerance on pipeline alone",
             lambda t: PipelineStrategy(fault_tolerance=True),
             TypeError, r"PipelineStrategy has no option 'fault_tolerance'.*no data-parallel replicate axis", CONSTRUCTION),
    BadInput("fault_tolerance with an unreachable lighthouse",
             lambda t: _fit(FSDP2Strategy(fault_tolerance={"replica_group_id": 0, "num_replica_groups": 2,
                                                           "lighthouse": "http://127.0.0.1:9", "connect_timeout": 3})),
             RuntimeError, r"the torchft lighthouse at http://127\.0\.0\.1:9 did not answer within 3 s.*torchft_lighthouse --min_replicas 1"),
    # --- precision
    BadInput("A precision plugin of another strategy family", lambda t: _deepspeed_precision(),
             ValueError, r"DeepSpeedPrecision.*cannot be used with lightning_dist strategies\. Pass `precision=` with one of: 32-true"),
    BadInput("float8 without torchao installed", lambda t: _without_torchao(lambda: _fit(FSDP2Strategy(float8="rowwise"))),
             ModuleNotFoundError, r"float8='rowwise' needs torchao, which is not installed\. Install it with: pip install 'lightning-dist\[fp8\]'"),
    BadInput("An unknown float8 recipe", lambda t: FSDP2Strategy(float8="e4m3"),
             ValueError, r"float8='e4m3' is not a float8 recipe\. Use one of \['rowwise', 'tensorwise', 'mxfp8'\]", CONSTRUCTION),
    BadInput("float8 on a GPU without FP8 matmuls (an A100, SM80)", lambda t: _float8_on_gpu("rowwise", (8, 0)),
             ValueError, r"float8='rowwise' needs FP8 matmuls, which need a GPU of compute capability 8\.9 or newer"),
    BadInput("float8='mxfp8' on an H100 (SM90)", lambda t: _float8_on_gpu("mxfp8", (9, 0)),
             ValueError, r"float8='mxfp8' needs .* 10\.0 or newer \(B200 or newer\); this GPU is 9\.0"),
    BadInput("float8='mxfp8' with checkpointing on", lambda t: _fit(FSDP2Strategy(float8="mxfp8"), default_root_dir=t),
             ValueError, r"float8='mxfp8' runs cannot be checkpointed yet: torchao 0\.18 keeps MXFP8 weights.*enable_checkpointing=False"),
    BadInput("float8='tensorwise' with an int reshard_after_forward",
             lambda t: _fit(FSDP2Strategy(float8="tensorwise", reshard_after_forward=2), devices=4),
             ValueError, r"float8='tensorwise' all-gathers FP8 weights through FSDP2's tensor-subclass hooks, which torch does not support with an int reshard_after_forward=2"),
    # --- checkpoints and callbacks
    BadInput("A ckpt_path that does not exist", lambda t: _fit("fsdp2", ckpt_path=t / "epoch=3.ckpt"),
             CheckpointError, r"Checkpoint not found: '.*epoch=3\.ckpt' does not exist"),
    BadInput("A ckpt_path of an unfinished save", lambda t: _fit("fsdp2", ckpt_path=_unfinished(t)),
             CheckpointError, r"not a complete checkpoint"),
    BadInput("A ckpt_path whose DCP index would run code when unpickled (a crafted or untrusted checkpoint)",
             lambda t: _fit("fsdp2", ckpt_path=_crafted_index(t)),
             CheckpointError, r"DCP index .*names 'builtins\.exec', which is not one of the metadata types.*weights_only=False"),
    BadInput("A ckpt_path whose DCP index names a file in another folder ('../other/x.distcp')",
             lambda t: _fit("fsdp2", ckpt_path=_escaping("index with ..")(t)),
             CheckpointError, r"is refused: its DCP index names '\.\./outside/stolen\.distcp', a path outside the checkpoint folder"),
    BadInput("A ckpt_path whose DCP index names an absolute path",
             lambda t: _fit("fsdp2", ckpt_path=_escaping("index with an absolute path")(t)),
             CheckpointError, r"is refused: its DCP index names '.*/outside/stolen\.distcp', an absolute path outside the checkpoint folder"),
    BadInput("A ckpt_path whose shard is a symbolic link out of its folder",
             lambda t: _fit("fsdp2", ckpt_path=_escaping("shard linked outside")(t)),
             CheckpointError, r"'__0_0\.distcp', named by its COMPLETE manifest, leads outside the checkpoint folder through a symbolic link.*cp -rL"),
    BadInput("save_last='link' with the async checkpoint plugin",
             lambda t: _fit("fsdp2", plugins=[AsyncDistributedCheckpointIO()], callbacks=[ModelCheckpoint(save_last="link")]),
             ValueError, r"ModelCheckpoint\(save_last='link'\) cannot be combined with AsyncDistributedCheckpointIO"),
    BadInput("Lightning's ModelPruning callback under fsdp2",
             lambda t: _fit("fsdp2", callbacks=[ModelPruning("l1_unstructured", amount=0.5)]),
             ValueError, r"ModelPruning cannot run under FSDP2Strategy: torch\.nn\.utils\.prune ranks whole weight tensors"
             r".*Prune in one process or under strategy='ddp'.*lightning-dist consolidate"),
    BadInput("StochasticWeightAveraging in a test after fit, on the model fsdp2 sharded",
             lambda t: _trainer_with(StochasticWeightAveraging(swa_lrs=0.01)).test(_sharded_by_an_earlier_fit()),
             RuntimeError, r"StochasticWeightAveraging copies the LightningModule \(copy.deepcopy\) in its setup\(\) when"
             r" test starts.*FSDP2 modules cannot be deep-copied.*test without it"),
    BadInput("WeightAveraging (EMA) fitting a model an earlier fsdp2 fit sharded",
             lambda t: _trainer_with(WeightAveraging()).fit(_sharded_by_an_earlier_fit()),
             RuntimeError, r"WeightAveraging copies the LightningModule.*when fit starts.*Fit a fresh, unsharded instance"),
    BadInput("initial_weights: a safetensors file cut short", _damaged_safetensors("cut short"),
             CheckpointError, _DAMAGED_FILE + r"tensor 'b' ends at byte 76 of the data, which has 66 \(the file is cut short\)"),
    BadInput("initial_weights: a safetensors header that puts two tensors on the same bytes", _damaged_safetensors("overlap"),
             CheckpointError, _DAMAGED_FILE + r"tensor 'a' starts at byte 0 of the data, where 'b' ends at 12 \(overlapping it\)"),
    BadInput("initial_weights: a safetensors tensor whose offsets run past its bytes", _damaged_safetensors("past the end"),
             CheckpointError, _DAMAGED_FILE + r"tensor 'b' \(F32 \[3\]\) needs 12 bytes, but its offsets 64–1,000 hold 936"),
    BadInput("initial_weights: a safetensors dtype whose size disagrees with the bytes", _damaged_safetensors("dtype"),
             CheckpointError, _DAMAGED_FILE + r"tensor 'b' \(F64 \[3\]\) needs 24 bytes, but its offsets 64–76 hold 12"),
    BadInput("initial_weights: a safetensors header entry without its shape", _damaged_safetensors("no shape"),
             CheckpointError, _DAMAGED_FILE + r"its entry for tensor 'b' has no shape"),
    BadInput("initial_weights: a safetensors header that is a JSON list", _damaged_safetensors("list"),
             CheckpointError, _DAMAGED_FILE + r"its header is a JSON list, not an object of tensors"),
    BadInput("initial_weights into a model wrapped with PEFT's DoRA (LoRA with use_dora=True)", _peft_from_initial_weights("dora"),
             CheckpointError, r"cannot be read into this model after it was built: 2 adapter layers depend on the base weights"
             r".*q_proj: a LoRA variant \(DoRA.*its magnitude is computed from the base weight when get_peft_model runs.*"
             r"Use plain LoRA"),
    BadInput("initial_weights into a model wrapped with PEFT's IA3", _peft_from_initial_weights("ia3"),
             CheckpointError, r"k_proj: a PEFT Linear layer \(peft\.tuners\.ia3\.layer\): initial_weights reads pretrained"
             r" weights under LoRA's Linear layers \(peft\.tuners\.lora\.Linear\) only"),
    BadInput("initial_weights into LoRA initialized from the base weights (init_lora_weights='pissa')",
             _peft_from_initial_weights("pissa"),
             CheckpointError, r"q_proj: LoRA init_lora_weights='pissa' \(adapter 'default'\) computes the adapters from the base"
             r" weights when get_peft_model runs, before initial_weights are read"),
    BadInput("initial_weights: a model.safetensors that is a folder", _damaged_safetensors("folder"),
             CheckpointError, r"Pretrained weights: '<dir>/model\.safetensors' is a folder, not a safetensors file"),
    # --- Lightning Fabric (docs/fabric.md)
    BadInput("A pipeline strategy name in L.Fabric", lambda t: _fabric("pipeline"),
             ValueError, r"The pipeline strategies need the Trainer: a pipeline schedule runs forward and backward",
             CONSTRUCTION),
    BadInput("A pipeline axis in a Fabric hybrid3d mesh",
             lambda t: _fabric(fabric_strategies.Hybrid3DStrategy(pipeline_parallel_size=2, data_parallel_shard_size=1)),
             ValueError, r"Hybrid3DStrategy: the mesh has a pipeline axis \(pp=2\), which a Fabric loop cannot drive",
             CONSTRUCTION),
    BadInput("An option of the Trainer's loop in a Fabric strategy",
             lambda t: fabric_strategies.FSDP2Strategy(on_nonfinite="skip"),
             ValueError, r"FSDP2Strategy\(on_nonfinite='skip'\) is a Trainer option here: the Trainer's loop skips",
             CONSTRUCTION),
    BadInput("mesh='auto' in a Fabric hybrid3d strategy", lambda t: fabric_strategies.Hybrid3DStrategy(mesh="auto"),
             ValueError, r"Hybrid3DStrategy\(mesh='auto'\) under Fabric: the mesh is built at fabric\.launch\(\)",
             CONSTRUCTION),
]  # fmt: skip


def _trainer_with(callback: Any) -> Trainer:
    return Trainer(
        strategy=FSDP2Strategy(), accelerator="cpu", devices=2, logger=False, max_steps=1, callbacks=[callback]
    )


def _sharded_by_an_earlier_fit() -> GPT:
    """A GPT as a finished fsdp2 fit leaves it: FSDP2 units (applied here over a one-process group, closed again)
    and the mark of the strategy that parallelized it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_dist.strategies.lifecycle.preflight import PARALLELIZED, parallel_settings

    model = _gpt()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()
    object.__setattr__(model, PARALLELIZED, parallel_settings(FSDP2Strategy()))
    return model


def _without_torchao(attempt: Callable[[], Any]) -> Any:
    """``attempt()`` as on a machine where torchao is not installed (the package asks for its version there)."""
    import lightning_dist.strategies.lifecycle.float8 as setup

    found = setup.torchao_version
    setup.torchao_version = lambda: None
    try:
        return attempt()
    finally:
        setup.torchao_version = found


def _float8_on_gpu(recipe: str, capability: tuple[int, int]) -> None:
    """The check ``fit`` runs before launch on CUDA, with the compute capability such a GPU reports (no GPU here)."""
    from lightning_dist.parallel.float8 import float8_emulation

    float8_emulation(recipe, "cuda", capability)  # type: ignore[arg-type]


def _deepspeed_precision() -> None:
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision

    Trainer(strategy="fsdp2", accelerator="cpu", devices=2, plugins=[DeepSpeedPrecision("16-mixed")])


def _fabric(strategy: Any) -> None:
    from lightning.fabric import Fabric

    Fabric(strategy=strategy, accelerator="cpu", devices=2)


def forbid_launch() -> Callable[[], None]:
    """Make process creation fail; returns the undo."""
    original = _SubprocessScriptLauncher._call_children_scripts

    def refuse(self: _SubprocessScriptLauncher) -> None:
        raise AssertionError("processes were launched although the configuration is invalid")

    _SubprocessScriptLauncher._call_children_scripts = refuse  # type: ignore[method-assign]
    return lambda: setattr(_SubprocessScriptLauncher, "_call_children_scripts", original)


def error_text(row: BadInput, tmp_path: Path) -> tuple[BaseException | None, str]:
    """Make the mistake of ``row``; return the exception and its text (with what a CLI printed on stderr)."""
    stderr = StringIO()
    try:
        with redirect_stderr(stderr):
            row.attempt(tmp_path)
    except BaseException as err:  # noqa: BLE001 (SystemExit included: the CLI's parse errors)
        # an exit with a message says it all (what else is on stderr is warnings, which Python shows once per process)
        said = err.code if isinstance(err, SystemExit) and isinstance(err.code, str) else f"{err}\n{stderr.getvalue()}"
        return err, said.replace(str(tmp_path), "<dir>")
    return None, stderr.getvalue()


def damaged_checkpoint_text(case: Any, tmp_path: Path) -> str:
    """What resuming from the damaged checkpoint of ``case`` (a ``test_checkpoint_integrity`` case) says."""
    import test_checkpoint_integrity as damaged  # type: ignore[import-not-found]

    from lightning_dist.checkpoint import model_state
    from lightning_dist.checkpoint.validation import validate_checkpoint

    path = case.build(tmp_path)
    model = damaged._model()
    try:
        validate_checkpoint(path)
        model_state.load_checkpoint_into(path, model, [damaged._optimizer(model)], strict=True)
    except CheckpointError as err:
        return str(err).replace(str(tmp_path), "<dir>")
    raise AssertionError(f"the damaged checkpoint {case.name!r} loaded without an error")


def render(texts: dict[str, tuple[BaseException | None, str]] | None = None) -> str:
    """The "Common errors" table of ``docs/errors.md``, from the rows' real messages (``texts``: already collected
    ones, by mistake; the others are made here, launches forbidden)."""
    texts = dict(texts or {})
    lines = ["| Mistake | Caught | What you are told |", "|---|---|---|"]
    undo = forbid_launch()
    try:
        for row in ROWS:
            if row.mistake not in texts:
                with tempfile.TemporaryDirectory() as tmp:
                    texts[row.mistake] = error_text(row, Path(tmp))
            err, text = texts[row.mistake]
            lines.append(f"| {row.mistake} | {row.caught} | {_abridged(type(err).__name__, text)} |")
    finally:
        undo()
    return "\n".join(lines + [damaged_row(case, text) for case, text in damaged_texts()])


def damaged_texts() -> list[tuple[Any, str]]:
    """Each damaged-checkpoint case of ``test_checkpoint_integrity`` with what resuming from it says."""
    from test_checkpoint_integrity import CASES as DAMAGED  # type: ignore[import-not-found]

    texts = []
    for case in DAMAGED:
        with tempfile.TemporaryDirectory() as tmp:
            texts.append((case, damaged_checkpoint_text(case, Path(tmp))))
    return texts


def damaged_row(case: Any, text: str) -> str:
    """The docs row of a damaged-checkpoint case whose resume said ``text``."""
    caught = BEFORE_LAUNCH if case.before_launch else "when the bytes are read"
    return f"| Damaged checkpoint: {case.name} | {caught} | {_abridged('CheckpointError', text)} |"


#: What a message may hold that depends on the machine that made it, not on the mistake: each is shown in the docs as a
#: placeholder, and the rest of the message is compared exactly. Checksums are of float tensors (the vectorised
#: kernels of another processor round differently), ports and process ids are whatever the OS gave, timings and
#: paths are the machine's.
MACHINE_DEPENDENT: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\b(CRC-32|recorded|checksum|SHA-256|sha256|digest)( of)? [0-9a-f]{8,64}\b"), r"\1\2 <checksum>"),
    (re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{16,64}\b"), "<checksum>"),
    (
        re.compile(r"\b(127\.0\.0\.1|localhost|\[::1?\]):(?:102[4-9]|10[3-9]\d|1[1-9]\d\d|[2-9]\d{3}|\d{5})\b"),
        r"\1:<port>",
    ),
    (re.compile(r"\b(pid|PID|process) \d{2,}\b"), r"\1 <pid>"),
    (re.compile(r"\b\d+\.\d+ ?(s|ms|seconds)\b"), r"<seconds> \1"),
]


def stable_text(text: str) -> str:
    """``text`` with what depends on the machine (:data:`MACHINE_DEPENDENT`, the paths of this checkout, of the
    installed packages and of the temporary folder) replaced by placeholders."""
    installed = str(Path(torch.__file__).resolve().parents[1])  # where this Python's packages are
    for path, placeholder in (
        (str(REPO_ROOT), "<repo>"),
        (installed, "<site-packages>"),
        (tempfile.gettempdir(), "<tmp>"),
    ):
        text = text.replace(path, placeholder)
    for pattern, placeholder in MACHINE_DEPENDENT:
        text = pattern.sub(placeholder, text)
    return text


def _abridged(kind: str, text: str) -> str:
    text = stable_text(text)
    if "error: Parser key" in text:  # jsonargparse: the innermost complaint and the value it was about
        lines = [line.strip() for line in text[text.index("error: Parser key") :].splitlines()]
        inner = [i for i, line in enumerate(lines) if line.startswith(("Parser key", "Option ", "error: Parser key"))]
        given = next((line for line in lines[inner[-1] :] if line.startswith("Given value:")), "")
        text = f"{lines[inner[-1]]} {given}"
    message = re.sub(r"\s+", " ", text).strip().replace("|", "\\|")
    return f"`{kind}`: {message[:300]}{'…' if len(message) > 300 else ''}"


ERRORS_DOC = REPO_ROOT / "docs" / "errors.md"
START, END = "<!-- common-errors:start -->", "<!-- common-errors:end -->"


def docs_section() -> str:
    """The "Common errors" table as ``docs/errors.md`` holds it now."""
    text = ERRORS_DOC.read_text()
    return text[text.index(START) + len(START) : text.index(END)].strip()


def write_docs() -> None:
    """Regenerate the "Common errors" table of ``docs/errors.md`` from the rows' real messages."""
    text = ERRORS_DOC.read_text()
    head, tail = text[: text.index(START) + len(START)], text[text.index(END) :]
    ERRORS_DOC.write_text(f"{head}\n{render()}\n{tail}")


if __name__ == "__main__":
    write_docs() if "--write-docs" in sys.argv else print(render())
