"""The step part of ``fault_tolerance``: the quorum before each batch, the gradient average across replica groups
(during the backward under FSDP2, else after it), and the commit of each step (see the step protocol's order)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_dist.parallel.fault_tolerance import check_lighthouse
from lightning_dist.strategies.lifecycle.step_part import StepPart, StepRun

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.strategies.base import MeshParallelStrategy
    from lightning_dist.strategies.parallelisms.fault_tolerance.option import FaultToleranceOption


class FaultTolerancePart(StepPart):
    """The part of a strategy with :class:`FaultToleranceOption` set: the quorum, the gradient average across
    groups and the commit of each step."""

    strategy: FaultToleranceOption
    axis = "replica_groups"

    @classmethod
    def applies_to(cls, strategy: MeshParallelStrategy) -> bool:
        return getattr(strategy, "fault_tolerance", None) is not None

    def preflight_before_model(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        options = self.strategy.fault_tolerance
        assert options is not None and options.lighthouse is not None
        check_lighthouse(options.lighthouse, options.connect_timeout)

    def after_setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self.strategy.join_replica_groups(trainer)

    def before_training_batch(self, trainer: pl.Trainer) -> None:
        groups = self.strategy.replica_groups
        if groups is None:
            return
        before = groups.quorum_size
        groups.start_step()
        if groups.quorum_size != before:
            self.strategy.log_decision(
                f"quorum of {groups.quorum_size} of {groups.options.num_replica_groups} replica groups from global"
                f" step {trainer.global_step} (was {before})"
            )

    def wrap_training_step(self, run: StepRun) -> StepRun:
        def training_step(*args: Any, **kwargs: Any) -> Any:
            output = run(*args, **kwargs)
            self.strategy.log_fault_tolerance()
            return output

        return training_step

    def after_backward(self) -> None:
        groups = self.strategy.replica_groups
        if groups is not None and not groups.reduces_in_backward:  # else averaged during the backward
            parameters = [p for p in self.strategy.model.parameters() if p.requires_grad]
            groups.average_gradients(parameters)

    def commits_optimizer_step(self) -> bool:
        groups = self.strategy.replica_groups
        if groups is None:
            return True
        committed = groups.commit()
        if committed:
            self.strategy.record_progress()
        else:
            rank_zero_warn(
                f"fault_tolerance: the update of global step {self.strategy.lightning_module.trainer.global_step} was"
                " discarded on every live replica group (a group failed during the step, or fewer than"
                f" min_replica_groups={groups.options.min_replica_groups} took part); its samples are not trained on."
            )
        return committed
