"""Expert parallelism's part in a step: with ``log_expert_load``, each training step logs every MoE layer's expert
load (``max / mean`` tokens per expert over the whole batch, :func:`~lightning_dist.parallel.expert_parallel.
take_expert_load`) as ``expert_load/<experts module>``. The experts' split itself is
:class:`~lightning_dist.strategies.expert_parallel_option.ExpertParallelOption`'s."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_dist.parallel.expert_parallel import take_expert_load
from lightning_dist.strategies.expert_parallel_option import ExpertParallelOption
from lightning_dist.strategies.steps.part import StepPart, StepRun


class ExpertParallelPart(StepPart):
    """The part of a strategy with :class:`ExpertParallelOption` on a mesh with ``ep > 1``."""

    strategy: ExpertParallelOption
    mixin, axis = ExpertParallelOption, "ep"

    def wrap_training_step(self, run: StepRun) -> StepRun:
        if not self.strategy.log_expert_load:
            return run

        def training_step(*args: Any, **kwargs: Any) -> Any:
            output = run(*args, **kwargs)
            self._log_load()
            return output

        return training_step

    def _log_load(self) -> None:
        strategy = self.strategy
        loads = take_expert_load(strategy.model, strategy.mesh["loss"].get_group())
        if strategy.parallel_dims.pp > 1:  # each stage counted its own layers: every rank logs all of them
            stages: list[Any] = [None] * strategy.parallel_dims.pp
            dist.all_gather_object(stages, loads, group=strategy.process_group("pp"))
            loads = {name: value for stage in stages for name, value in stage.items()}
        # the same values on every rank already (summed over the data-parallel ranks): no sync_dist
        strategy.lightning_module.log_dict({f"expert_load/{n}": v for n, v in loads.items()}, on_step=True)
