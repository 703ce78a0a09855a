"""Parameters shared by units of different stages (an input embedding tied to the output head), Megatron style.

Each stage that uses a tied parameter keeps its own copy under its own name (``transformer.wte.weight`` on the
first stage, ``lm_head.weight`` on the last). After backward the copies' gradients are summed over the ranks that
hold them, so every copy takes the same step and stays equal. Stages on one rank (the V placement puts the first and
the last stage on rank 0) share the one Parameter object and need nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.parallel.pipeline.split import StagePlacement, StagePlan, stage_ids_for_rank


@dataclass(frozen=True)
class TiedParameter:
    """One Parameter registered under several names in units of different stages.

    Attributes:
        names: Every qualified name of the parameter, in stage order (the forward's order, not registration's:
            litgpt registers ``lm_head`` before the embedding).
        stages: The stage of each name.
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]

    def describe(self) -> str:
        return " = ".join(f"{n} (stage {s})" for n, s in zip(self.names, self.stages))


def find_tied_parameters(model: nn.Module, plan: StagePlan) -> list[TiedParameter]:
    """The parameters whose names fall in units of more than one stage (call before cutting)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    ties = []
    for names in by_id.values():
        placed = sorted(((_stage_of_param(plan, n), n) for n in names), key=lambda pair: pair[0])
        if len(names) > 1 and len({stage for stage, _ in placed}) > 1:
            ties.append(TiedParameter(tuple(n for _, n in placed), tuple(stage for stage, _ in placed)))
    return ties


def tied_parameter_ranks(
    tie: TiedParameter, pp_size: int, stages_per_rank: int, placement: StagePlacement = "loop"
) -> list[int]:
    """The pipeline ranks holding a copy of ``tie`` (one rank: nothing to synchronise)."""
    holders = {
        rank
        for rank in range(pp_size)
        if set(stage_ids_for_rank(rank, pp_size, stages_per_rank, placement)) & set(tie.stages)
    }
    return sorted(holders)


def new_tie_groups(
    ties: Sequence[TiedParameter],
    pipeline_groups: Sequence[Sequence[int]],
    stages_per_rank: int,
    placement: StagePlacement = "loop",
) -> list[Any]:
    """Create, on every process (a collective), one process group per tie and pipeline group; return this rank's.

    Args:
        ties: From :func:`find_tied_parameters`.
        pipeline_groups: The global ranks of every pipeline group, in pipeline-rank order.
        stages_per_rank: Stages per rank.
        placement: The stage placement.

    Returns:
        For each tie, the group this process belongs to, or ``None`` (not a holder, or a single holder).
    """
    me = dist.get_rank()
    mine: list[Any] = []
    for tie in ties:
        found = None
        for ranks in pipeline_groups:
            holders = [ranks[r] for r in tied_parameter_ranks(tie, len(ranks), stages_per_rank, placement)]
            if len(holders) < 2:
                continue
            group = dist.new_group(holders)
            if me in holders:
                found = group
        mine.append(found)
    return mine


def all_reduce_tied_gradients(model: nn.Module, ties: Sequence[TiedParameter], groups: Sequence[Any]) -> None:
    """Give every copy of each tied parameter the sum of all copies' gradients: the copies on this rank are added
    up, then summed over the tie's group. Call on every rank after backward, before clipping."""
    for tie, group in zip(ties, groups):
        copies = _local_copies(model, tie)
        if not copies:
            if group is not None:
                raise RuntimeError(
                    f"This rank is in the group of the tied parameter {tie.describe()} but holds no copy."
                )
            continue
        if len(copies) == 1 and group is None:
            continue
        for param in copies:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        total = copies[0].grad
        for param in copies[1:]:
            total = total + param.grad
        local = total.to_local() if hasattr(total, "to_local") else total
        if group is not None:
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        for param in copies:
            param.grad.copy_(total)


def broadcast_tied_parameters(model: nn.Module, ties: Sequence[TiedParameter], groups: Sequence[Any]) -> None:
    """Make every copy equal to the first copy on the lowest holder rank (after materialising or loading)."""
    for tie, group in zip(ties, groups):
        copies = _local_copies(model, tie)
        if not copies:
            continue
        source = copies[0].data
        if group is not None:
            local = source.to_local() if hasattr(source, "to_local") else source
            dist.broadcast(local, group=group, group_src=0)
        with torch.no_grad():
            for param in copies[1:]:
                param.copy_(source)


def _local_copies(model: nn.Module, tie: TiedParameter) -> list[nn.Parameter]:
    """The distinct Parameter objects this rank holds for ``tie``, in name order."""
    found: list[nn.Parameter] = []
    for name in tie.names:
        try:
            param = model.get_parameter(name)
        except AttributeError:
            continue
        if all(param is not p for p in found):
            found.append(param)
    return found


def _stage_of_param(plan: StagePlan, name: str) -> int:
    for index, units in enumerate(plan.stages):
        if any(name.startswith(f"{u}.") for u in units):
            return index
    raise ValueError(f"Parameter {name} is in no pipeline unit.")
