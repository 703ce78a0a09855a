"""Optimizers on a pipeline stage that holds none of the parameters they update (a frozen first stage, say).

A stage holds only its own parameters, so an optimizer written for one process (``AdamW(filter(lambda p:
p.requires_grad, self.parameters()))``) gets an empty parameter list on a stage whose parameters are all frozen, and
torch refuses that ("optimizer got an empty parameter list"). In one process the same call sees the trainable
parameters of the other stages. While :func:`optimizers_may_be_empty` is open, such an optimizer is built with one
parameter group holding no parameters (the optimizer's defaults): it steps nothing, its learning-rate scheduler and
the step count advance as on every other stage, and the stage still runs forward and backward in the schedule.
:func:`stages_to_optimize` then learns, over the pipeline group, which stages have nothing to optimize, and refuses a
pipeline where no stage has anything (what torch refuses in one process).
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

_EMPTY_LIST = "optimizer got an empty parameter list"  # torch.optim.Optimizer's refusal, quoted in our error


@dataclass
class EmptyOptimizers:
    """What :func:`optimizers_may_be_empty` did: the optimizers it gave one empty parameter group, by class name."""

    built: list[str] = field(default_factory=list)


@contextmanager
def optimizers_may_be_empty() -> Generator[EmptyOptimizers, None, None]:
    """While open, a ``torch.optim.Optimizer`` (any subclass that calls its ``__init__``) built from an empty
    iterable of parameters gets one parameter group without parameters instead of torch's ``ValueError``. Everything
    else about its construction is unchanged."""
    record = EmptyOptimizers()
    original = Optimizer.__init__

    def init(self: Optimizer, params: Any, defaults: dict[str, Any]) -> None:
        if not isinstance(params, torch.Tensor):
            params = list(params)  # a generator or filter() is consumed once, here
            if not params:
                record.built.append(type(self).__name__)
                params = [{"params": []}]
        original(self, params, defaults)

    Optimizer.__init__ = init  # type: ignore[method-assign]
    try:
        yield record
    finally:
        Optimizer.__init__ = original  # type: ignore[method-assign]


def optimized_parameter_count(optimizers: Iterable[Any]) -> int:
    """The parameters that ``optimizers`` update: those in their param groups that require a gradient."""
    return sum(
        1
        for optimizer in optimizers
        for group in getattr(optimizer, "param_groups", [])
        for p in group.get("params", [])
        if isinstance(p, torch.Tensor) and p.requires_grad
    )


#: What a rank reports: its stage indices, how many parameters its optimizers update, and the optimizers that
#: :func:`optimizers_may_be_empty` gave one empty group there (class names).
StageReport = tuple[list[int], int, list[str]]


@dataclass(frozen=True)
class StageOptimization:
    """The stages of a pipeline that have nothing to optimize (stage indices, sorted)."""

    idle_stages: list[int]
    num_stages: int

    @classmethod
    def of(cls, reports: Sequence[StageReport]) -> StageOptimization:
        """From every rank's report over a pipeline group. Raises ``ValueError`` when optimizers were built from
        empty parameter lists and no stage has anything to optimize, as torch does in one process."""
        idle = sorted(s for ids, count, _ in reports if count == 0 for s in ids)
        num_stages = sum(len(ids) for ids, _, _ in reports)
        built = sorted({name for _, _, names in reports for name in names})
        if built and len(idle) == num_stages:
            raise ValueError(
                f"No pipeline stage has a parameter to optimize: configure_optimizers built {', '.join(built)} from"
                f" an empty parameter list on every stage ({_EMPTY_LIST}, as torch says in one process). Every"
                " parameter is frozen (requires_grad=False) or left out of the optimizer: unfreeze some, or pass them"
                " to it."
            )
        return cls(idle, num_stages)

    def describe(self) -> str:
        stages = ", ".join(str(s) for s in self.idle_stages)
        one = len(self.idle_stages) == 1
        return (
            f"{'stage' if one else 'stages'} {stages} (of {self.num_stages}) {'holds' if one else 'hold'} no parameter"
            " to optimize (frozen, or left out of the optimizer): it runs forward and backward in the schedule, its"
            " optimizer steps nothing, and learning-rate schedulers and global_step advance as on every stage"
        )


def stages_to_optimize(
    stage_ids: Sequence[int], optimizers: Iterable[Any], empty: EmptyOptimizers, group: dist.ProcessGroup
) -> StageOptimization:
    """Over the pipeline ``group`` (one rank per stage position): which stages have no parameter to optimize (see
    :meth:`StageOptimization.of`, which refuses a pipeline with nothing to optimize anywhere). ``stage_ids``: this
    rank's stages; ``empty``: what :func:`optimizers_may_be_empty` did here. Collective."""
    mine: StageReport = (list(stage_ids), optimized_parameter_count(optimizers), empty.built)
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return StageOptimization.of(everyone)
