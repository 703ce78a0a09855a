"""Gradient accumulation with FSDP2: gradients reduced after every micro-batch, or only after the last.

Each scenario fits STEPS optimizer steps of ACCUMULATE micro-batches in fp64 and reports the losses, the final
parameters, the reduce-scatter bytes this rank sent per optimizer step, and the largest gradient memory held between
micro-batches (sharded gradients plus FSDP2's unsharded accumulation buffers).

python tests/scenarios/accumulation_runs.py --devices 2 --out r.json --workdir DIR --scenarios every,last
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from common import (  # type: ignore[import-not-found]
    StepRecorder,
    full_state,
    is_rank_zero,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_dist import ContextParallelStrategy, FSDP2Strategy
from lightning_dist.parallel.fsdp import fsdp_modules
from lightning_dist.profiling import CommCounter

STEPS = 3
ACCUMULATE = 4


class _GradientMemory(Callback):
    """The largest gradient memory this rank holds after a micro-batch's backward."""

    def __init__(self) -> None:
        self.peak = 0

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        held = sum(_local(p.grad).nbytes for p in pl_module.parameters() if p.grad is not None)
        for module in fsdp_modules(pl_module):
            group = module._get_fsdp_state()._fsdp_param_group
            for param in group.fsdp_params if group is not None else []:
                if param.unsharded_accumulated_grad is not None:
                    held += param.unsharded_accumulated_grad.nbytes
                elif param.unsharded_param.grad is not None:
                    held += param.unsharded_param.grad.nbytes
        self.peak = max(self.peak, held)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _fit(
    devices: int, workdir: str, mode: str, cls: type = FSDP2Strategy, name: str = "", **options: Any
) -> dict[str, Any]:
    # context parallel: both ranks see the same batch (dp_shard=1), each a half of every sequence
    model, data = make_model_and_data(devices, dp_size=1 if cls is ContextParallelStrategy else None)
    recorder, memory = StepRecorder(), _GradientMemory()
    strategy = cls(accumulation_sync=mode, **options) if devices > 1 else "auto"
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true"),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=0.5,
        callbacks=[recorder, memory],
    )
    with CommCounter() as counter:
        trainer.fit(model, data)
    params = full_state(model)
    if is_rank_zero():
        torch.save(params, f"{workdir}/accumulate_{name or mode}_d{devices}.pt")
    reduce_scatter = sum(r.sent_bytes for r in counter.records if "reduce_scatter" in r.op)
    # gradient all-reduces across HSDP replicas; the loss is all-reduced every micro-batch for logging
    all_reduce = sum(r.sent_bytes for r in counter.records if r.op.startswith("all_reduce") and r.tensor_bytes > 8)
    return {
        "losses": recorder.losses,
        "all_reduce_bytes_per_step": all_reduce / STEPS,
        "grad_norms": recorder.grad_norms,
        "reduce_scatter_bytes_per_step": reduce_scatter / STEPS,
        "peak_gradient_bytes": memory.peak,
    }


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "every": lambda devices, workdir: _fit(devices, workdir, "every"),
    "last": lambda devices, workdir: _fit(devices, workdir, "last"),
    # HSDP with 2 replica groups of one rank: only the cross-replica all-reduce is deferred
    "hybrid_every": lambda devices, workdir: _fit(
        devices, workdir, "every", sharding="hybrid", data_parallel_replicate_size=2
    ),
    "replicas_last": lambda devices, workdir: _fit(
        devices, workdir, "replicas_last", sharding="hybrid", data_parallel_replicate_size=2
    ),
    # context parallel (cp=2): FSDP2 shards over cp, so "last" defers its reduce-scatter as under fsdp2
    "cp_every": lambda devices, workdir: _fit(devices, workdir, "every", ContextParallelStrategy, "cp_every"),
    "cp_last": lambda devices, workdir: _fit(devices, workdir, "last", ContextParallelStrategy, "cp_last"),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
