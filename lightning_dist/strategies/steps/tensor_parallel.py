"""Tensor parallelism's part in a step: with loss parallel, ``F.cross_entropy`` on vocabulary-sharded logits from
forward to the end of backward, a failure inside the step explained, and the step's loss checked to be a local
tensor; at setup, the plan of a model an earlier Trainer parallelized. The plan itself is
:class:`~lightning_dist.strategies.tensor_parallel_steps.TensorParallelSteps`'s."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from lightning_dist.parallel.tensor_parallel.loss_parallel import (
    VocabParallelCrossEntropy,
    check_local_loss,
    explain_loss_parallel_failure,
)
from lightning_dist.strategies.steps.part import StepPart, StepRun
from lightning_dist.strategies.tensor_parallel_steps import TensorParallelSteps

if TYPE_CHECKING:
    import lightning.pytorch as pl


class TensorParallelPart(StepPart):
    """The part of a strategy with :class:`TensorParallelSteps` on a mesh with ``tp > 1``."""

    strategy: TensorParallelSteps
    mixin, axis = TensorParallelSteps, "tp"

    def after_setup(self, trainer: pl.Trainer) -> None:
        self.strategy.restore_tensor_parallel_plan()

    def train_contexts(self) -> list[AbstractContextManager]:
        return [VocabParallelCrossEntropy()] if self.strategy.loss_parallel_head is not None else []

    def wrap_training_step(self, run: StepRun) -> StepRun:
        head = self.strategy.loss_parallel_head
        if head is None:
            return run

        def training_step(*args: Any, **kwargs: Any) -> Any:
            with explain_loss_parallel_failure(head):
                output = run(*args, **kwargs)
            check_local_loss(output)
            return output

        return training_step
