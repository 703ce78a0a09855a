"""LoRA (PEFT's ``get_peft_model``) under tensor parallelism against one process: a stock Llama with LoRA on
q_proj/v_proj (column-wise bases; ``merge_and_unload()`` after training), a Qwen3 with LoRA on every projection,
dropout 0.1 and sequence parallel (row-wise bases: o_proj, down_proj), and Phi-3's fused qkv_proj/gate_up_proj with
LoRA (its tp=2 checkpoint resumed under fsdp2); tp=2, and (4 devices) dp2 × tp2 and hybrid3d pp2 × tp2.

python tests/scenarios/lora_runs.py --devices 2 --out r.json --workdir DIR --scenarios llama,qwen3_all_sp
python tests/scenarios/lora_runs.py --devices 1 --out ref.json --workdir DIR --scenarios llama,qwen3_all   # reference
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from common import (  # type: ignore[import-not-found]
    GLOBAL_BATCH,
    SEQ_LEN,
    LogLines,
    OneProcessData,
    StepRecorder,
    in_checkpoint_order,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from models import LoraCausalLM  # type: ignore[import-not-found]
from torch.distributed.tensor import DTensor

from examples.data import TextDataModule
from lightning_dist import FSDP2Strategy, Hybrid3DStrategy, TensorParallelStrategy

STEPS = 6  # two 3-step epochs: the step-3 checkpoint resumes at an epoch boundary
CKPT_STEP = 3
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"kind": "llama"},
    "qwen3_all": {"kind": "qwen3", "targets": ALL_LINEAR, "lora_dropout": 0.1},
    "phi3": {"kind": "phi3", "targets": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")},
}


def _strategy(devices: int, layout: str, **options: Any) -> Any:
    if devices == 1:
        return "auto"
    if layout == "fsdp2":
        return FSDP2Strategy()
    if layout == "hybrid3d":  # pp2 × tp2 at 4 devices
        return Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_shard_size=1)
    dp = devices // 2
    return TensorParallelStrategy(tensor_parallel_size=2, data_parallel_shard_size=dp, **options)


def _dp(devices: int, layout: str) -> int:
    return {"fsdp2": devices, "tp": devices // 2, "hybrid3d": 1}[layout] if devices > 1 else 1


def _full(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + n: in_checkpoint_order(model, n, p) for n, p in model.named_parameters()}


def _placements(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's tp layout: ``S(0)``/``S(1)``/``R``, or ``plain`` (not on the tp mesh)."""
    out = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            out[name] = "plain"
            continue
        placement = dict(zip(p.device_mesh.mesh_dim_names or (), p.placements)).get("tp")
        out[name] = "plain" if placement is None else str(placement)  # FSDP2 alone: whole on every tp rank
    return out


def train(
    devices: int,
    workdir: str,
    name: str,
    model_name: str,
    layout: str = "tp",
    checkpoint: bool = False,
    merge: bool = False,
    resume_from: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Fit STEPS AdamW steps in float64; the losses, the LoRA parameters and frozen weights (saved by rank 0 as full
    tensors), the parameters' layouts and the plan's log line; optionally a checkpoint every CKPT_STEP steps, then
    ``merge_and_unload()`` and the merged model's logits."""
    L.seed_everything(1234, verbose=False)
    dp = _dp(devices, layout)
    data_cls = OneProcessData if devices == 1 else TextDataModule
    data = data_cls(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, train_samples=3 * GLOBAL_BATCH, val_samples=32)
    model = LoraCausalLM(**MODELS[model_name])
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    recorder, lines = StepRecorder(), LogLines("plan over tp")
    callbacks: list[Any] = [recorder]
    if checkpoint:
        folder = f"{workdir}/ckpt_{name}_d{devices}"
        callbacks.append(
            ModelCheckpoint(dirpath=folder, every_n_train_steps=CKPT_STEP, save_top_k=-1, filename="{step}")
        )
    trainer = L.Trainer(
        **trainer_kwargs(
            devices,
            strategy=_strategy(devices, layout, **options),
            precision="64-true",
            enable_checkpointing=checkpoint,
        ),
        max_steps=STEPS,
        callbacks=callbacks,
    )
    trainer.fit(model, data, ckpt_path=resume_from and f"{workdir}/{resume_from}/step={CKPT_STEP}.ckpt")
    lines.close()
    params = _full(model)
    frozen_change = max(
        (params[n] - before).abs().max().item() for n, before in frozen_before.items() if n in params
    )  # a pipeline stage holds its own layers only
    result: dict[str, Any] = {
        "losses": recorder.losses,
        "global_step": trainer.global_step,
        "placements": _placements(model),
        "plan_lines": lines.lines,
        "frozen_max_change": frozen_change,
        "frozen_compared": sum(n in params for n in frozen_before),
    }
    saved: dict[str, Any] = {"params": {n: v for n, v in params.items() if "lora_" in n}}
    if merge:
        merged = model.model.merge_and_unload()
        ids = torch.arange(2 * SEQ_LEN).reshape(2, SEQ_LEN) % 63
        with torch.no_grad():
            logits = merged(input_ids=ids).logits
        saved["merged_logits"] = logits.full_tensor() if isinstance(logits, DTensor) else logits
        saved["merged"] = {n: v for n, v in _full(merged).items() if "q_proj" in n or "v_proj" in n}
        result["merged_names"] = sorted(n for n, _ in merged.named_modules() if "lora" in n.lower())
    if trainer.is_global_zero:
        torch.save(saved, f"{workdir}/{name}_d{devices}.pt")
    return result


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    # references (1 device) and tp=2 / dp2 × tp2 runs of the same modules
    "llama": lambda d, w: train(d, w, "llama", "llama", merge=d <= 2),
    "qwen3_all": lambda d, w: train(d, w, "qwen3_all", "qwen3_all"),
    "phi3": lambda d, w: train(d, w, "phi3", "phi3", checkpoint=d == 2),
    "phi3_fsdp2_from_tp": lambda d, w: train(d, w, "phi3_fsdp2_from_tp", "phi3", "fsdp2", resume_from="ckpt_phi3_d2"),
    "qwen3_all_sp": lambda d, w: train(d, w, "qwen3_all_sp", "qwen3_all", sequence_parallel=True),
    "llama_hybrid3d": lambda d, w: train(d, w, "llama_hybrid3d", "llama", "hybrid3d"),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
