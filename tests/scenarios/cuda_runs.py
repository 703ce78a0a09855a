"""CUDA scenarios, one process on one GPU (run by tests/test_cuda.py only when a GPU is visible).

Each resume builds a new model and Trainer in the same process and resumes from the step-3 checkpoint of an
uninterrupted 6-step run; the losses of steps 4-6 must equal the uninterrupted run's.

python tests/scenarios/cuda_runs.py --devices 1 --out r.json --workdir DIR --scenarios bf16_async_resume
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from common import StepRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.tensor import DTensor

from lightning_dist import AsyncDistributedCheckpointIO, FSDP2Precision, FSDP2Strategy

STEPS = 6
SAVE_EVERY = 3


class _Placement(Callback):
    """Where parameters, gradients and optimizer state live at the first optimizer step."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.seen:
            return

        def devices(tensors: Any) -> list[str]:
            return sorted({str((t.to_local() if isinstance(t, DTensor) else t).device.type) for t in tensors})

        params = list(pl_module.parameters())
        self.seen = {
            "parameters": devices(params),
            "gradients": devices(p.grad for p in params if p.grad is not None),
            "buffers": devices(pl_module.buffers()),
        }

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        states = [s for state in trainer.optimizers[0].state.values() for s in state.values() if torch.is_tensor(s)]
        self.seen["optimizer_state"] = sorted(
            {str((s.to_local() if isinstance(s, DTensor) else s).device.type) for s in states if s.dim() > 0}
        )


def _fit(workdir: str, name: str, precision: str, resume_from: str | None = None, **strategy: Any) -> dict[str, Any]:
    # The data module of the multi-process runs, so Lightning injects its sampler and a mid-epoch resume skips exactly.
    model, data = make_model_and_data(2, dp_size=1, train_samples=32)
    recorder, placement = StepRecorder(), _Placement()
    checkpoints = ModelCheckpoint(
        dirpath=f"{workdir}/{name}", every_n_train_steps=SAVE_EVERY, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        **trainer_kwargs(
            1,
            accelerator="cuda",
            use_distributed_sampler=True,
            strategy=FSDP2Strategy(**strategy),
            precision=precision,
            enable_checkpointing=True,
        ),
        max_steps=STEPS,
        callbacks=[recorder, placement, checkpoints],
        plugins=[AsyncDistributedCheckpointIO(pinned_memory=True)],
    )
    trainer.fit(model, data, ckpt_path=resume_from)
    peak = torch.cuda.max_memory_allocated()
    return {"losses": recorder.losses, "placement": placement.seen, "peak_cuda_bytes": peak}


def _straight_and_resumed(workdir: str, name: str, precision: str, **strategy: Any) -> dict[str, Any]:
    torch.cuda.reset_peak_memory_stats()
    straight = _fit(workdir, name, precision, **strategy)
    resumed = _fit(workdir, f"{name}_resumed", precision, f"{workdir}/{name}/step=3.ckpt", **strategy)
    return {"straight": straight, "resumed": resumed}


def bf16_async_resume(devices: int, workdir: str) -> dict[str, Any]:
    return _straight_and_resumed(workdir, "bf16", "bf16-mixed")


def offload_resume(devices: int, workdir: str) -> dict[str, Any]:
    result = _straight_and_resumed(workdir, "offload", "bf16-mixed", cpu_offload=True)
    torch.cuda.reset_peak_memory_stats()
    result["without_offload_peak_cuda_bytes"] = _fit(workdir, "no_offload", "bf16-mixed")["peak_cuda_bytes"]
    return result


class _OverflowOnce(Callback):
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step == 0:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            grad.to_local().view(-1)[0] = float("inf")


def fp16_skip(devices: int, workdir: str) -> dict[str, Any]:
    model, data = make_model_and_data(1)
    plugin = FSDP2Precision("16-mixed")
    trainer = L.Trainer(
        **trainer_kwargs(1, accelerator="cuda", strategy=FSDP2Strategy(), plugins=[plugin]),
        max_steps=1,
        callbacks=[_OverflowOnce()],
    )
    before = {
        k: v.full_tensor().clone() if isinstance(v, DTensor) else v.clone() for k, v in model.state_dict().items()
    }
    trainer.fit(model, data)
    after = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return {
        "skipped": plugin.scaler.skipped_steps,
        "unchanged": all(torch.equal(before[k].cpu(), after[k].cpu()) for k in before),
    }


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "bf16_async_resume": bf16_async_resume,
    "offload_resume": offload_resume,
    "fp16_skip": fp16_skip,
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
