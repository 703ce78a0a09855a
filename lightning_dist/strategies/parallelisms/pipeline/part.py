"""Pipeline parallelism's part in a step: it runs the steps itself. A training step's forward and backward run per
micro-batch inside the schedule (Lightning's backward is then skipped), an evaluation step runs the forward-only
pass, and a weight tied across stages gets its copies' gradients summed before clipping. Before launch the first
training batch is checked and manual optimization refused; at setup the tied copies are made equal, and a stage
with nothing to optimize gets an optimizer that steps nothing. The work is done by
:class:`~.step.PipelineSteps`, which declares this part."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_dist.strategies.lifecycle.step_part import StepPart

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.strategies.parallelisms.pipeline.step import PipelineSteps


class PipelinePart(StepPart):
    """The part of a strategy with :class:`PipelineSteps` on a mesh with ``pp > 1``."""

    strategy: PipelineSteps
    runs_steps = True
    axis = "pp"

    def preflight_before_model(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        self.strategy.refuse_manual_optimization()

    def preflight_after_model(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        self.strategy.check_first_training_batch(trainer, arguments)

    def before_setup(self, trainer: pl.Trainer) -> None:
        self.strategy.refuse_manual_optimization()  # ranks that torchrun or SLURM started: no launching process

    def wrap_optimizer_setup(self, setup: Callable[[], None]) -> Callable[[], None]:
        return functools.partial(self.strategy.setup_stage_optimizers, setup)

    def after_setup(self, trainer: pl.Trainer) -> None:
        self.strategy.let_the_schedule_run_backward(trainer)

    def before_training_batch(self, trainer: pl.Trainer) -> None:
        # again: StochasticWeightAveraging turns Lightning's backward back on at every epoch end
        self.strategy.let_the_schedule_run_backward(trainer)

    def weight_aliases(self) -> dict[str, tuple[str, ...]]:
        return self.strategy.tied_weight_aliases()

    def make_copies_equal(self) -> None:
        self.strategy.equalize_tied_copies()

    def after_backward(self) -> None:
        self.strategy.sum_tied_gradients()

    def run_training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.strategy.pipelined_training_step(*args, **kwargs)

    def run_backward(self, closure_loss: Tensor) -> Tensor:
        return closure_loss  # the schedule ran backward inside the training step

    def run_eval_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        return self.strategy.pipelined_eval_step(step, *args, **kwargs)
