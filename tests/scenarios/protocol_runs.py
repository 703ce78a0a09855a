"""The step protocol of the shared base, on real processes: train_context() spans forward and backward (activation
checkpoint recompute runs inside it), and with pipeline stages (a pp axis) reduce() hands every rank the loss stage's
value and gradient norms sum over the stages.

python tests/scenarios/protocol_runs.py --devices 2 --out r.json --workdir DIR --scenarios recompute,stages
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback
from torch.nn import Module

from lightning_dist import FSDP2Strategy
from lightning_dist.parallel.grad_clip import total_grad_norm
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize

ACTIVE = {"train_context": False}


@contextmanager
def _flag() -> Iterator[None]:
    ACTIVE["train_context"] = True
    try:
        yield
    finally:
        ACTIVE["train_context"] = False


class ProbedFSDP2(FSDP2Strategy):
    """fsdp2 whose train_context sets a flag, as loss parallel or context parallel would enter their contexts."""

    def train_context(self) -> ExitStack:
        stack = super().train_context()
        stack.enter_context(_flag())
        return stack


def recompute(devices: int, workdir: str) -> dict[str, Any]:
    """Which block forwards (first passes and activation-checkpoint recomputes) ran inside train_context."""
    model, data = make_model_and_data(devices)
    seen: list[tuple[bool, bool]] = []  # (inside train_context, grad enabled) per block forward
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: seen.append((ACTIVE["train_context"], torch.is_grad_enabled())))
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=ProbedFSDP2(activation_checkpointing=True), limit_val_batches=1),
        max_steps=2,
        val_check_interval=2,
    )
    trainer.fit(model, data)
    return {"seen": seen, "blocks": len(model.blocks), "open_after_fit": ACTIVE["train_context"]}


class TwoStages(MeshParallelStrategy):
    """The mesh of a 2-stage pipeline (pp=2) without a pipeline: enough to check what the base does per stage."""

    log_name = "stages"

    def mesh_sizes(self) -> dict[str, MeshSize]:
        return {"pp": "auto"}

    def parallelize(self, model: Module) -> Module:
        return model


class _StageChecks(Callback):
    def __init__(self) -> None:
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        rank = dist.get_rank()
        # only the last stage (rank 1) holds the true loss; stage 0 holds a placeholder
        self.result["reduced"] = float(strategy.reduce(torch.tensor(10.0 if rank == 1 else -1.0)))
        # stage r holds a gradient of (r + 1) in 4 elements: the norm over both stages is sqrt(4 + 16)
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        p.grad = torch.full((4,), float(rank + 1), dtype=torch.float64)
        self.result["stage_norm"] = float(total_grad_norm([p]))
        self.result["global_norm"] = float(total_grad_norm([p], stage_group=strategy.process_group("pp")))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.result)
        self.result = {"per_rank": gathered}


def stages(devices: int, workdir: str) -> dict[str, Any]:
    model, data = make_model_and_data(devices, dp_size=1)
    checks = _StageChecks()
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=TwoStages()), max_steps=1, callbacks=[checks])
    trainer.fit(model, data)
    return checks.result


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {"recompute": recompute, "stages": stages}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
