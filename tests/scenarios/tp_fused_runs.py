"""Tensor parallel on fused attention projections: Hugging Face GPT-2 (Conv1D c_attn, tied embeddings) and
GPT-NeoX (query_key_value) against one process; stock LlamaForCausalLM with sequence parallel and with 2 key/value
heads at tp=4; litgpt's GPT (fused qkv, grouped-query attention), Phi-3 (qkv_proj, gate_up_proj), Falcon
(query_key_value per group and multi-query); fused-QKV checkpoints (GPT-2, nn.MultiheadAttention, litgpt, Phi-3)
moving between tensor_parallel and fsdp2, and consolidated into the library's own class. tp_runs.py runs the GPT-2/NeoX/Llama ones in its launches, test_tp_fused.py the library ones in its own.

python tests/scenarios/tp_fused_runs.py --devices 2 --out r.json --workdir DIR --scenarios gpt2,neox
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import (  # type: ignore[import-not-found]
    GLOBAL_BATCH,
    SEQ_LEN,
    OneProcessData,
    StepRecorder,
    is_rank_zero,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from llama_like import EncoderLM, LlamaLike  # type: ignore[import-not-found]
from torch.distributed.tensor import DTensor, Shard
from tp_library_models import LitGPTLM, falcon_model, phi3_model  # type: ignore[import-not-found]

from examples.data import TextDataModule
from lightning_dist import FSDP2Strategy, TensorParallelStrategy
from lightning_dist.parallel.tp_checkpoint_layout import permuted_parameters, to_checkpoint_order
from lightning_dist.profiling import state_bytes

STEPS = 5
VOCAB = 64
CLIP = 0.5


def hf_model(kind: str) -> torch.nn.Module:
    """A tiny ``GPT2LMHeadModel`` (tied embeddings) or ``GPTNeoXForCausalLM``, without dropout."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    if kind == "phi3":
        return phi3_model(SEQ_LEN)
    if kind.startswith("falcon"):
        return falcon_model(SEQ_LEN, new_decoder_architecture=kind == "falcon_gqa")
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, tie_word_embeddings=True, attn_implementation="eager",
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    if kind == "hf_llama":  # grouped-query attention: 8 query heads, 2 key/value heads
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN, attn_implementation="eager",
        )  # fmt: skip
        return LlamaForCausalLM(config)
    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=SEQ_LEN, hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
        attn_implementation="eager",
    )  # fmt: skip
    return GPTNeoXForCausalLM(config)


class HFCausalLM(LlamaLike):
    """A Hugging Face causal LM (``hf``) with LlamaLike's training and validation steps."""

    def __init__(self, kind: str) -> None:
        super().__init__(vocab_size=VOCAB)
        del self.model, self.lm_head
        self.hf = hf_model(kind)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids).logits


def model_and_data(kind: str, devices: int, dp: int, train_samples: int = 256) -> tuple[L.LightningModule, Any]:
    L.seed_everything(1234, verbose=False)
    data_cls = OneProcessData if devices == 1 else TextDataModule
    data = data_cls(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, train_samples=train_samples, val_samples=32)
    if kind == "litgpt":
        return LitGPTLM(SEQ_LEN), data
    return (EncoderLM() if kind == "mha" else HFCausalLM(kind)), data


def in_checkpoint_order(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A full parameter (or gradient) in the library's row order, as checkpoints hold it."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    permuted = permuted_parameters(model)
    if name in permuted:
        _, dim, order = permuted[name]
        full = to_checkpoint_order(full, dim, order)
    return full.detach().cpu().clone()


class GradRecorder(Callback):
    """Full gradients of every parameter (checkpoint row order) at every optimizer step, before clipping."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.steps.append({n: in_checkpoint_order(pl_module, n, p.grad) for n, p in pl_module.named_parameters()})


def strategy(devices: int, dp: int = 1, **options: Any) -> Any:
    if devices == 1:
        return "auto"
    return TensorParallelStrategy(tensor_parallel_size=devices // dp, data_parallel_shard_size=dp, **options)


def train(devices: int, workdir: str, name: str, kind: str, dp: int = 1, **options: Any) -> dict[str, Any]:
    """Fit STEPS clipped optimizer steps; full grads and params (checkpoint order) saved by rank 0."""
    model, data = model_and_data(kind, devices, dp)
    recorder, grads = StepRecorder(), GradRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy(devices, dp, **options), precision="64-true"),
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


EPOCH_SAMPLES = 3 * GLOBAL_BATCH
CKPT_STEPS = 6


def _ckpt_strategy(kind: str) -> Any:
    return TensorParallelStrategy(tensor_parallel_size=2) if kind == "tp" else FSDP2Strategy()


def checkpoint_save(devices: int, workdir: str, model_kind: str, kind: str) -> dict[str, Any]:
    """Fit CKPT_STEPS steps under ``kind`` (tp or fsdp2) with a sharded checkpoint every 3 steps."""
    model, data = model_and_data(model_kind, devices, 1 if kind == "tp" else devices, train_samples=EPOCH_SAMPLES)
    recorder = StepRecorder()
    folder = f"{workdir}/ckpt_{model_kind}_{kind}"
    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=_ckpt_strategy(kind), precision="64-true", enable_checkpointing=True),
        max_steps=CKPT_STEPS,
        callbacks=[recorder, ckpt],
    )
    trainer.fit(model, data)
    return {"losses": recorder.losses}


def checkpoint_resume(devices: int, workdir: str, model_kind: str, kind: str, saved_by: str) -> dict[str, Any]:
    """Resume the step-3 checkpoint written under ``saved_by`` with ``kind`` and fit to CKPT_STEPS."""
    model, data = model_and_data(model_kind, devices, 1 if kind == "tp" else devices, train_samples=EPOCH_SAMPLES)
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=_ckpt_strategy(kind), precision="64-true"),
        max_steps=CKPT_STEPS,
        callbacks=[recorder],
    )
    trainer.fit(model, data, ckpt_path=f"{workdir}/ckpt_{model_kind}_{saved_by}/step=3.ckpt")
    return {"losses": recorder.losses, "global_step": trainer.global_step}


def _max_over_ranks(value: int) -> int:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


FUSED_SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "gpt2": lambda d, w: train(d, w, "gpt2", "gpt2"),
    "neox": lambda d, w: train(d, w, "neox", "neox"),
    "gpt2_2d": lambda d, w: train(d, w, "gpt2_2d", "gpt2", dp=2),
    "neox_2d": lambda d, w: train(d, w, "neox_2d", "neox", dp=2),
    "hf_llama": lambda d, w: train(d, w, "hf_llama", "hf_llama"),
    "hf_llama_sp": lambda d, w: train(d, w, "hf_llama_sp", "hf_llama", sequence_parallel=True),
    "hf_llama_tp4": lambda d, w: train(d, w, "hf_llama_tp4", "hf_llama"),  # at 4 devices: 2 KV heads < tp
    "gpt2_save_tp": lambda d, w: checkpoint_save(d, w, "gpt2", "tp"),
    "gpt2_save_fsdp2": lambda d, w: checkpoint_save(d, w, "gpt2", "fsdp2"),
    "gpt2_fsdp2_from_tp": lambda d, w: checkpoint_resume(d, w, "gpt2", "fsdp2", "tp"),
    "gpt2_tp_from_fsdp2": lambda d, w: checkpoint_resume(d, w, "gpt2", "tp", "fsdp2"),
    "mha_save_tp": lambda d, w: checkpoint_save(d, w, "mha", "tp"),
    "mha_fsdp2_from_tp": lambda d, w: checkpoint_resume(d, w, "mha", "fsdp2", "tp"),
    "litgpt": lambda d, w: train(d, w, "litgpt", "litgpt"),
    "litgpt_save_tp": lambda d, w: checkpoint_save(d, w, "litgpt", "tp"),
    "litgpt_fsdp2_from_tp": lambda d, w: checkpoint_resume(d, w, "litgpt", "fsdp2", "tp"),
    "litgpt_save_fsdp2": lambda d, w: checkpoint_save(d, w, "litgpt", "fsdp2"),
    "litgpt_tp_from_fsdp2": lambda d, w: checkpoint_resume(d, w, "litgpt", "tp", "fsdp2"),
    "phi3": lambda d, w: train(d, w, "phi3", "phi3"),
    "phi3_save_tp": lambda d, w: checkpoint_save(d, w, "phi3", "tp"),
    "phi3_fsdp2_from_tp": lambda d, w: checkpoint_resume(d, w, "phi3", "fsdp2", "tp"),
    "falcon_gqa": lambda d, w: train(d, w, "falcon_gqa", "falcon_gqa"),
    "falcon_mqa": lambda d, w: train(d, w, "falcon_mqa", "falcon_mqa"),
    "gpt2_sp": lambda d, w: train(d, w, "gpt2_sp", "gpt2", sequence_parallel=True),
    "mha_sp": lambda d, w: train(d, w, "mha_sp", "mha", sequence_parallel=True),
    "mha": lambda d, w: train(d, w, "mha", "mha"),
    "litgpt_2d": lambda d, w: train(d, w, "litgpt_2d", "litgpt", dp=2),
    "gpt2_tp4": lambda d, w: train(d, w, "gpt2_tp4", "gpt2"),  # at 4 devices
    "neox_tp4": lambda d, w: train(d, w, "neox_tp4", "neox"),  # at 4 devices
    "litgpt_tp4": lambda d, w: train(d, w, "litgpt_tp4", "litgpt"),  # at 4 devices: 2 query groups < tp
    "phi3_tp4": lambda d, w: train(d, w, "phi3_tp4", "phi3"),  # at 4 devices: 2 key/value heads < tp
}


if __name__ == "__main__":
    run_scenario_script(FUSED_SCENARIOS)
