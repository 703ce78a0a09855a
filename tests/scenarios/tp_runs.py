"""Tensor-parallel scenarios: parity with one process (GPT, a Llama-like HF-named model, an nn.TransformerEncoder
LM), sequence and loss parallel, 2D with FSDP2, bf16-mixed, and checkpoints moving between tensor_parallel and
fsdp2; and tensor parallel on fused attention projections of library models (GPT-2, GPT-NeoX, stock Llama,
litgpt, Phi-3, Falcon), their checkpoints moving between tensor_parallel and fsdp2 and consolidated into the library's
own class.

python tests/scenarios/tp_runs.py --devices 2 --out r.json --workdir DIR --scenarios gpt,llama
python tests/scenarios/tp_runs.py --devices 1 --out ref.json --workdir DIR --scenarios gpt,llama   # reference
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import (  # type: ignore[import-not-found]
    GLOBAL_BATCH,
    SEQ_LEN,
    GradRecorder,
    OneProcessData,
    StepRecorder,
    in_checkpoint_order,
    is_rank_zero,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from models import EncoderLM, LitGPTLM, LlamaLike, hf_model  # type: ignore[import-not-found]
from torch.distributed.tensor import DTensor, Shard

from examples.data import TextDataModule
from lightning_dist import FSDP2Strategy, TensorParallelStrategy
from lightning_dist.profiling import state_bytes

STEPS = 5
VOCAB = 64
CLIP = 0.5


def model_and_data(
    kind: str, devices: int, dp: int, train_samples: int = 256, **model_kwargs: Any
) -> tuple[L.LightningModule, Any]:
    # The data has 63 token ids; the models get 64 so that tp=2 and tp=4 divide the vocabulary.
    if kind == "gpt":
        return make_model_and_data(devices, dp_size=dp, train_samples=train_samples, vocab_size=VOCAB)
    L.seed_everything(1234, verbose=False)
    data_cls = OneProcessData if devices == 1 else TextDataModule
    data = data_cls(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, train_samples=train_samples, val_samples=32)
    return (EncoderLM if kind == "encoder" else LlamaLike)(vocab_size=VOCAB, **model_kwargs), data


def tp_strategy(devices: int, dp: int = 1, **kwargs: Any) -> Any:
    if devices == 1:
        return "auto"
    return TensorParallelStrategy(tensor_parallel_size=devices // dp, data_parallel_shard_size=dp, **kwargs)


def train(
    devices: int,
    workdir: str,
    name: str,
    kind: str,
    dp: int = 1,
    precision: str = "64-true",
    model_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Fit STEPS optimizer steps with gradient clipping, validate, save full grads and params (rank 0)."""
    model, data = model_and_data(kind, devices, dp, **(model_kwargs or {}))
    recorder, grads = StepRecorder(), GradRecorder()
    strategy = tp_strategy(devices, dp, **kwargs)
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision=precision),
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        callbacks=[recorder, grads],
    )
    trainer.fit(model, data)
    param_bytes = state_bytes(model)["parameters"]
    sharded = sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements[-1:])
    )
    metrics = trainer.validate(model, data, verbose=False)[0]
    metric_copy = copy.deepcopy(model.val_accuracy)  # the strategy's metric sync keeps metrics copyable
    assert metric_copy.dist_sync_fn is model.val_accuracy.dist_sync_fn
    params = {n: in_checkpoint_order(model, n, p) for n, p in model.named_parameters()}
    if is_rank_zero():
        torch.save({"params": params, "grads": grads.steps}, f"{workdir}/{name}_d{devices}.pt")
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "val": {k: float(v) for k, v in metrics.items()},
        "param_bytes_max_rank": _max_over_ranks(param_bytes),
        "tp_sharded_param_bytes": sharded,
        "param_bytes_total": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def bf16(devices: int, workdir: str, dp: int = 1) -> dict[str, Any]:
    """bf16-mixed (pure TP: autocast; 2D: FSDP2's policy): dtypes at rest, in compute and of gradients; losses."""
    model, data = model_and_data("gpt", devices, dp)
    seen: dict[str, str] = {}

    def record(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["linear_output"] = str(output.dtype)

    model.blocks[0].attn.query.register_forward_hook(record)
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=tp_strategy(devices, dp), precision="bf16-mixed"),
        max_steps=STEPS,
        callbacks=[recorder],
    )
    trainer.fit(model, data)
    first_output = seen.get("linear_output")
    if dp == 1:  # a second Trainer reuses the parallelized model (no `parallelize`): autocast must still be on
        seen.clear()
        again = L.Trainer(
            **trainer_kwargs(devices, strategy=tp_strategy(devices, dp), precision="bf16-mixed"), max_steps=1
        )
        again.fit(model, data)
        seen["second_fit_linear_output"] = seen.pop("linear_output", None)
        seen["second_fit_plan_restored"] = getattr(again.strategy, "_tp_plan", None) is not None
    seen["linear_output"] = first_output
    return {
        "plugin": type(trainer.strategy.precision_plugin).__name__,
        "at_rest": sorted({str(p.dtype) for p in model.parameters()}),
        "grad": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
        "losses": recorder.losses,
        **seen,
    }


# Checkpoints resume the data position exactly at epoch boundaries: 3-step epochs, saved at the end of the first.
EPOCH_SAMPLES = 3 * GLOBAL_BATCH
CKPT_STEPS = 6


def _ckpt_strategy(kind: str, devices: int) -> Any:
    if devices == 1:
        return "auto"
    return TensorParallelStrategy(tensor_parallel_size=devices) if kind == "tp" else FSDP2Strategy()


def _dp(kind: str, devices: int) -> int:
    return 1 if kind == "tp" else devices


def checkpoint_save(devices: int, workdir: str, kind: str) -> dict[str, Any]:
    """Fit CKPT_STEPS steps with a sharded checkpoint every 3 steps under ``kind`` (tp or fsdp2)."""
    model, data = model_and_data("gpt", devices, _dp(kind, devices), train_samples=EPOCH_SAMPLES)
    recorder = StepRecorder()
    ckpt = ModelCheckpoint(
        dirpath=f"{workdir}/ckpt_{kind}_d{devices}", every_n_train_steps=3, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        **trainer_kwargs(
            devices, strategy=_ckpt_strategy(kind, devices), precision="64-true", enable_checkpointing=True
        ),
        max_steps=CKPT_STEPS,
        callbacks=[recorder, ckpt],
    )
    trainer.fit(model, data)
    return {"losses": recorder.losses}


def checkpoint_resume(devices: int, workdir: str, kind: str, saved_by: str) -> dict[str, Any]:
    """Resume the step-3 checkpoint written under ``saved_by`` with the ``kind`` strategy and fit to CKPT_STEPS."""
    model, data = model_and_data("gpt", devices, _dp(kind, devices), train_samples=EPOCH_SAMPLES)
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=_ckpt_strategy(kind, devices), precision="64-true"),
        max_steps=CKPT_STEPS,
        callbacks=[recorder],
    )
    trainer.fit(model, data, ckpt_path=f"{workdir}/ckpt_{saved_by}_d{devices}/step=3.ckpt")
    return {"losses": recorder.losses, "global_step": trainer.global_step}


def meta_init(devices: int, workdir: str) -> dict[str, Any]:
    """The model created on the meta device (``empty_init=True``) and materialized after tensor parallelism."""
    _, data = model_and_data("gpt", devices, 1)
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=tp_strategy(devices, sequence_parallel=True), precision="64-true"),
        max_steps=3,
        callbacks=[recorder],
    )
    with trainer.init_module(empty_init=True):
        model, _ = model_and_data("gpt", devices, 1)
    trainer.fit(model, data)
    return {
        "losses": recorder.losses,
        "devices": sorted({str(p.device) for p in model.parameters()}),
        "local_shapes": {n: list(p.to_local().shape) for n, p in model.named_parameters() if isinstance(p, DTensor)},
    }


class _SyncMetricsOverWorld(Callback):
    """Undo the strategy's metric group: torchmetrics' default (WORLD) sync, to show what it would count."""

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.val_tokens.dist_sync_fn = None


def metrics_world_control(devices: int, workdir: str) -> dict[str, Any]:
    """Validation of the Llama-like model with its token-count metric synced over WORLD instead of ``loss``."""
    model, data = model_and_data("llama", devices, 1)
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=tp_strategy(devices), precision="64-true"),
        callbacks=[_SyncMetricsOverWorld()],
    )
    return {k: float(v) for k, v in trainer.validate(model, data, verbose=False)[0].items()}


class _HandWrittenLoss(LlamaLike):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"])
        logp = torch.log_softmax(logits, dim=-1)
        return -logp.gather(-1, batch["labels"].unsqueeze(-1)).mean()


def loss_parallel_unsupported_loss(devices: int, workdir: str) -> dict[str, Any]:
    """loss_parallel with a loss that is not F.cross_entropy: the error must say so (run last: it fails a fit)."""
    _, data = model_and_data("llama", devices, 1)
    model = _HandWrittenLoss(vocab_size=VOCAB)
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=tp_strategy(devices, loss_parallel=True), precision="64-true"),
        max_steps=1,
    )
    try:
        trainer.fit(model, data)
    except RuntimeError as err:  # LossParallelError is one
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def _max_over_ranks(value: int) -> int:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# The automatic GPT plan written out, plus replicated DTensor norms ("replicate" changes layouts, not values).
EXPLICIT_GPT_PLAN: dict[str, Any] = {
    "tok_emb": {"style": "rowwise", "input_layouts": "replicate", "output_layouts": "replicate"},
    "blocks.*.ln*": "replicate",
    "blocks.*.attn.query": "colwise",
    "blocks.*.attn.key": "colwise",
    "blocks.*.attn.value": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "ln_f": "replicate",
    "head": {"style": "colwise", "output_layouts": "replicate"},
}

SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "gpt": lambda d, w: train(d, w, "gpt", "gpt"),
    "llama": lambda d, w: train(d, w, "llama", "llama"),
    "gpt_sp": lambda d, w: train(d, w, "gpt_sp", "gpt", sequence_parallel=True),
    "gpt_lp": lambda d, w: train(d, w, "gpt_lp", "gpt", loss_parallel=True),
    "llama_sp_lp": lambda d, w: train(d, w, "llama_sp_lp", "llama", sequence_parallel=True, loss_parallel=True),
    "gpt_2d": lambda d, w: train(d, w, "gpt_2d", "gpt", dp=2),
    "llama_2d": lambda d, w: train(d, w, "llama_2d", "llama", dp=2),
    "llama_2d_sp_lp": lambda d, w: train(
        d, w, "llama_2d_sp_lp", "llama", dp=2, sequence_parallel=True, loss_parallel=True
    ),
    "llama_tied_lp": lambda d, w: train(
        d, w, "llama_tied_lp", "llama", model_kwargs={"tie_word_embeddings": True}, loss_parallel=True
    ),
    "encoder": lambda d, w: train(d, w, "encoder", "encoder"),
    "encoder_2d": lambda d, w: train(d, w, "encoder_2d", "encoder", dp=2),
    "llama_kv2": lambda d, w: train(d, w, "llama_kv2", "llama", model_kwargs={"num_key_value_heads": 2}),
    "gpt_explicit": lambda d, w: train(d, w, "gpt_explicit", "gpt", plan=EXPLICIT_GPT_PLAN),
    "gpt_sp_ac": lambda d, w: train(d, w, "gpt_sp_ac", "gpt", sequence_parallel=True, activation_checkpointing=True),
    "meta_init": meta_init,
    "bf16": bf16,
    "bf16_2d": lambda d, w: bf16(d, w, dp=2),
    "metrics_world_control": metrics_world_control,
    "lp_unsupported_loss": loss_parallel_unsupported_loss,
    "save_tp": lambda d, w: checkpoint_save(d, w, "tp"),
    "save_fsdp2": lambda d, w: checkpoint_save(d, w, "fsdp2"),
    "fsdp2_from_tp": lambda d, w: checkpoint_resume(d, w, "fsdp2", saved_by="tp"),
    "tp_from_fsdp2": lambda d, w: checkpoint_resume(d, w, "tp", saved_by="fsdp2"),
}


# ------------------------------------------------------------------------------------------------ fused projections
# Hugging Face GPT-2 (Conv1D c_attn, tied embeddings) and GPT-NeoX (query_key_value) against one process; stock
# LlamaForCausalLM with sequence parallel and with 2 key/value heads at tp=4; litgpt's GPT (fused qkv, grouped-query
# attention), Phi-3 (qkv_proj, gate_up_proj), Falcon (query_key_value per group and multi-query); fused-QKV
# checkpoints (GPT-2, nn.MultiheadAttention, litgpt, Phi-3) moving between tensor_parallel and fsdp2.
# test_tensor_parallel_parity.py runs the GPT-2/NeoX/Llama ones, test_tp_fused.py the library ones.


class LibraryLM(LlamaLike):
    """A Hugging Face causal LM (``hf``) with LlamaLike's training and validation steps."""

    def __init__(self, kind: str) -> None:
        super().__init__(vocab_size=VOCAB)
        del self.model, self.lm_head
        self.hf = hf_model(kind)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits


def fused_model_and_data(kind: str, devices: int, dp: int, train_samples: int = 256) -> tuple[L.LightningModule, Any]:
    L.seed_everything(1234, verbose=False)
    data_cls = OneProcessData if devices == 1 else TextDataModule
    data = data_cls(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, train_samples=train_samples, val_samples=32)
    if kind == "litgpt":
        return LitGPTLM(SEQ_LEN), data
    return (EncoderLM() if kind == "mha" else LibraryLM(kind)), data


def fused_train(devices: int, workdir: str, name: str, kind: str, dp: int = 1, **options: Any) -> dict[str, Any]:
    """Fit STEPS clipped optimizer steps; full grads and params (checkpoint order) saved by rank 0."""
    model, data = fused_model_and_data(kind, devices, dp)
    recorder, grads = StepRecorder(), GradRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=tp_strategy(devices, dp, **options), precision="64-true"),
        max_steps=STEPS,
        gradient_clip_val=CLIP,
        callbacks=[recorder, grads],
    )
    trainer.fit(model, data)
    sharded = sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements[-1:])
    )
    params = {n: in_checkpoint_order(model, n, p) for n, p in model.named_parameters()}
    if is_rank_zero():
        torch.save({"params": params, "grads": grads.steps}, f"{workdir}/{name}_d{devices}.pt")
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "param_bytes_max_rank": _max_over_ranks(state_bytes(model)["parameters"]),
        "tp_sharded_param_bytes": sharded,
        "param_bytes_total": sum(p.numel() * p.element_size() for p in model.parameters()),
        "plan_summary": getattr(trainer.strategy, "_tp_plan", None) and trainer.strategy._tp_plan.summary(),
    }


def _fused_ckpt_strategy(kind: str) -> Any:
    return TensorParallelStrategy(tensor_parallel_size=2) if kind == "tp" else FSDP2Strategy()


def fused_checkpoint_save(devices: int, workdir: str, model_kind: str, kind: str) -> dict[str, Any]:
    """Fit CKPT_STEPS steps under ``kind`` (tp or fsdp2) with a sharded checkpoint every 3 steps."""
    model, data = fused_model_and_data(model_kind, devices, 1 if kind == "tp" else devices, train_samples=EPOCH_SAMPLES)
    recorder = StepRecorder()
    folder = f"{workdir}/ckpt_{model_kind}_{kind}"
    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=_fused_ckpt_strategy(kind), precision="64-true", enable_checkpointing=True),
        max_steps=CKPT_STEPS,
        callbacks=[recorder, ckpt],
    )
    trainer.fit(model, data)
    return {"losses": recorder.losses}


def fused_checkpoint_resume(devices: int, workdir: str, model_kind: str, kind: str, saved_by: str) -> dict[str, Any]:
    """Resume the step-3 checkpoint written under ``saved_by`` with ``kind`` and fit to CKPT_STEPS."""
    model, data = fused_model_and_data(model_kind, devices, 1 if kind == "tp" else devices, train_samples=EPOCH_SAMPLES)
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=_fused_ckpt_strategy(kind), precision="64-true"),
        max_steps=CKPT_STEPS,
        callbacks=[recorder],
    )
    trainer.fit(model, data, ckpt_path=f"{workdir}/ckpt_{model_kind}_{saved_by}/step=3.ckpt")
    return {"losses": recorder.losses, "global_step": trainer.global_step}


FUSED_SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "gpt2": lambda d, w: fused_train(d, w, "gpt2", "gpt2"),
    "neox": lambda d, w: fused_train(d, w, "neox", "neox"),
    "gpt2_2d": lambda d, w: fused_train(d, w, "gpt2_2d", "gpt2", dp=2),
    "neox_2d": lambda d, w: fused_train(d, w, "neox_2d", "neox", dp=2),
    "hf_llama": lambda d, w: fused_train(d, w, "hf_llama", "hf_llama"),
    "hf_llama_sp": lambda d, w: fused_train(d, w, "hf_llama_sp", "hf_llama", sequence_parallel=True),
    "hf_llama_tp4": lambda d, w: fused_train(d, w, "hf_llama_tp4", "hf_llama"),  # at 4 devices: 2 KV heads < tp
    "gpt2_save_tp": lambda d, w: fused_checkpoint_save(d, w, "gpt2", "tp"),
    "gpt2_save_fsdp2": lambda d, w: fused_checkpoint_save(d, w, "gpt2", "fsdp2"),
    "gpt2_fsdp2_from_tp": lambda d, w: fused_checkpoint_resume(d, w, "gpt2", "fsdp2", "tp"),
    "gpt2_tp_from_fsdp2": lambda d, w: fused_checkpoint_resume(d, w, "gpt2", "tp", "fsdp2"),
    "mha_save_tp": lambda d, w: fused_checkpoint_save(d, w, "mha", "tp"),
    "mha_fsdp2_from_tp": lambda d, w: fused_checkpoint_resume(d, w, "mha", "fsdp2", "tp"),
    "litgpt": lambda d, w: fused_train(d, w, "litgpt", "litgpt"),
    "litgpt_save_tp": lambda d, w: fused_checkpoint_save(d, w, "litgpt", "tp"),
    "litgpt_fsdp2_from_tp": lambda d, w: fused_checkpoint_resume(d, w, "litgpt", "fsdp2", "tp"),
    "litgpt_save_fsdp2": lambda d, w: fused_checkpoint_save(d, w, "litgpt", "fsdp2"),
    "litgpt_tp_from_fsdp2": lambda d, w: fused_checkpoint_resume(d, w, "litgpt", "tp", "fsdp2"),
    "phi3": lambda d, w: fused_train(d, w, "phi3", "phi3"),
    "phi3_save_tp": lambda d, w: fused_checkpoint_save(d, w, "phi3", "tp"),
    "phi3_fsdp2_from_tp": lambda d, w: fused_checkpoint_resume(d, w, "phi3", "fsdp2", "tp"),
    "falcon_gqa": lambda d, w: fused_train(d, w, "falcon_gqa", "falcon_gqa"),
    "falcon_mqa": lambda d, w: fused_train(d, w, "falcon_mqa", "falcon_mqa"),
    "gpt2_sp": lambda d, w: fused_train(d, w, "gpt2_sp", "gpt2", sequence_parallel=True),
    "mha_sp": lambda d, w: fused_train(d, w, "mha_sp", "mha", sequence_parallel=True),
    "mha": lambda d, w: fused_train(d, w, "mha", "mha"),
    "litgpt_2d": lambda d, w: fused_train(d, w, "litgpt_2d", "litgpt", dp=2),
    "gpt2_tp4": lambda d, w: fused_train(d, w, "gpt2_tp4", "gpt2"),  # at 4 devices
    "neox_tp4": lambda d, w: fused_train(d, w, "neox_tp4", "neox"),  # at 4 devices
    "litgpt_tp4": lambda d, w: fused_train(d, w, "litgpt_tp4", "litgpt"),  # at 4 devices: 2 query groups < tp
    "phi3_tp4": lambda d, w: fused_train(d, w, "phi3_tp4", "phi3"),  # at 4 devices: 2 key/value heads < tp
}

SCENARIOS.update(FUSED_SCENARIOS)


if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
