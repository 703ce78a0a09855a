"""What one parallelism contributes to a strategy's steps: a :class:`StepPart`.

A parallelism's mixin declares its part (``declared_parts = (TensorParallelPart,)``); the step protocol finds the parts in
the strategy's class chain and states, once, the order in which they act
(:data:`~lightning_dist.strategies.lifecycle.step_protocol.PART_ORDER`). A part only says what it does at each point.
Every hook's default does nothing, so a part implements the few it needs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.strategies.base import MeshParallelStrategy

#: A step's run: ``training_step``'s (batch, batch_idx, ...) or an evaluation step's arguments → its output.
StepRun = Callable[..., Any]


class StepPart:
    """One parallelism's part in the strategy's checks, set-up and steps, on a mesh where its axis has more than one
    rank (see :meth:`~lightning_dist.strategies.lifecycle.step_protocol.StepProtocol.step_parts`).

    Args:
        strategy: The strategy whose steps this part joins; the part keeps no state of its own.
    """

    #: Whether the part runs forward and backward itself (the pipeline's schedule) instead of the root module.
    runs_steps = False

    def __init__(self, strategy: MeshParallelStrategy) -> None:
        self.strategy = strategy

    #: The mesh axis of this parallelism: the part takes part where it has more than one rank.
    axis: str

    @classmethod
    def applies_to(cls, strategy: MeshParallelStrategy) -> bool:
        """Whether this parallelism's mesh axis has more than one rank (the strategy's class chain declared it)."""
        return getattr(strategy.parallel_dims, cls.axis) > 1

    # ------------------------------------------------------------------ before launch and at setup
    def preflight_before_model(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        """Checks before launch, in the launching process, before the model is checked (``arguments``: the entry
        point's)."""

    def preflight_after_model(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        """Checks before launch, in the launching process, after the model is checked."""

    def before_setup(self, trainer: pl.Trainer) -> None:
        """At setup, before the model is parallelized."""

    def after_setup(self, trainer: pl.Trainer) -> None:
        """At setup, once the model, optimizers and precision are set up."""

    def after_parallelize(self) -> None:
        """At setup, once the model is parallelized, materialized and placed, before the optimizers are set up."""

    def make_copies_equal(self) -> None:
        """At setup, after the replicated parameters and buffers were made equal: copies this part keeps itself."""

    def weight_aliases(self) -> dict[str, tuple[str, ...]]:
        """Parameter name → the other names of the same weight, where this part keeps a copy per name (a pipeline's
        weight tied across stages): ``initial_weights`` loads each copy from whichever name a file holds."""
        return {}

    def wrap_optimizer_setup(self, setup: Callable[[], None]) -> Callable[[], None]:
        """``setup`` (Lightning's: the module's ``configure_optimizers``, when fitting) with what this part does
        around it."""
        return setup

    # ------------------------------------------------------------------ steps
    def before_training_batch(self, trainer: pl.Trainer) -> None:
        """Before each training batch, before Lightning builds the batch's optimizer closure."""

    def transform_batch(self, batch: Any, dataloader_idx: int) -> Any:
        """A batch once it reached the device."""
        return batch

    def train_contexts(self) -> list[AbstractContextManager]:
        """Contexts that stay active from a training step's forward to the end of its backward."""
        return []

    def wrap_training_step(self, run: StepRun) -> StepRun:
        """``run`` (the inner parts and the forward, or the schedule) with what this part does around it."""
        return run

    def wrap_eval_step(self, step: str, run: StepRun) -> StepRun:
        """The same for ``validation_step``/``test_step``/``predict_step``."""
        return run

    def after_backward(self) -> None:
        """After a step's backward (its accumulation window's last), before the gradients are resharded and
        clipped."""

    def make_gradients_consistent(self) -> None:
        """The gradients made what one process computes: under automatic optimization once they are resharded after
        the step's backward, before the non-finite check and clipping; under manual optimization after each
        ``manual_backward``, inside :meth:`manual_backward_context`."""

    def commits_optimizer_step(self) -> bool:
        """Whether the step's update is applied, asked once its gradients are final (after ``on_nonfinite``), before
        clipping: fault tolerance applies it only if every live replica group completed the step. ``False`` from any
        part drops the gradients, so the optimizer leaves every parameter and its state untouched."""
        return True

    def manual_backward_context(self) -> AbstractContextManager:
        """Around each ``manual_backward`` (manual optimization) and the :meth:`make_gradients_consistent` after it."""
        return nullcontext()

    # ------------------------------------------------------------------ a part that runs the steps (runs_steps)
    def run_training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Forward and backward of a training step."""
        raise NotImplementedError

    def run_backward(self, closure_loss: Tensor) -> Tensor:
        """What stands for Lightning's backward when :meth:`run_training_step` already ran it."""
        raise NotImplementedError

    def run_eval_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        """Forward of an evaluation step."""
        raise NotImplementedError


@functools.cache
def declared_step_parts(strategy_class: type, order: tuple[str, ...]) -> tuple[type[StepPart], ...]:
    """The parts that the mixins of ``strategy_class`` declare (``declared_parts``; for each axis the first in the
    class chain), ordered by their axis in ``order``; a part of an axis not in ``order`` comes last, in class-chain
    order."""
    parts: dict[str, type[StepPart]] = {}
    for klass in strategy_class.__mro__:
        for part in vars(klass).get("declared_parts", ()):
            parts.setdefault(part.axis, part)
    rank = {axis: index for index, axis in enumerate(order)}
    return tuple(sorted(parts.values(), key=lambda part: rank.get(part.axis, len(order))))
