"""Parameters shared by units of different stages (an input embedding tied to the output head), Megatron style.

Each stage that uses a tied parameter keeps its own copy under its own name (``transformer.wte.weight`` on the
first stage, ``lm_head.weight`` on the last). After backward the copies' gradients are summed over the ranks that
hold them, so every copy takes the same step and stays equal. Stages on one rank (the V placement puts the first and
the last stage on rank 0) get their own copies too (see :func:`~.stage.cut_pipeline_stages`); their gradients are
added up on the rank first.

Under tensor parallelism each stage lays its copy out by its own plan: GPT-2's embedding and head are both sharded
on the vocabulary, but a stage whose plan does not recognise the embedding keeps it whole while the last stage shards
the head. :func:`tied_layouts_agree` compares the holders' layouts once after parallelizing; copies laid out alike
sum their local shards, others sum whole tensors and each keeps its own slice. In the global gradient norm the
weight counts once, as in one process (:func:`count_tied_copies_once`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_dist.parallel.grad_clip import count_in_norm_elsewhere
from lightning_dist.parallel.pipeline.split import StagePlacement, StagePlan, stage_ids_for_rank
from lightning_dist.parallel.tensor_parallel.apply import shard_gradients_like_parameters


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


def tied_layouts_agree(model: nn.Module, ties: Sequence[TiedParameter], groups: Sequence[Any]) -> list[bool]:
    """For each tie, whether every copy on every holder is laid out alike (plain tensors of one shape, or DTensors
    with the same mesh shape, placements and local shape), so that the holders' local shards correspond. Call on every
    rank after parallelizing (a collective over each tie's group)."""
    agree = []
    for tie, group in zip(ties, groups):
        layouts = sorted({_layout(p) for p in _local_copies(model, tie)})
        if group is not None:
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, layouts, group=group)
            layouts = sorted({layout for mine in gathered for layout in mine})
        agree.append(len(layouts) <= 1)
    return agree


def count_tied_copies_once(model: nn.Module, ties: Sequence[TiedParameter]) -> None:
    """Leave every copy but the first stage's out of the global gradient norm: after
    :func:`all_reduce_tied_gradients` the copies hold one gradient, which one process counts once. Call after
    parallelizing (the Parameter objects clipping sees)."""
    for tie in ties:
        first = _parameter(model, tie.names[0])
        for param in _local_copies(model, tie):
            if param is not first:
                count_in_norm_elsewhere(param)


def all_reduce_tied_gradients(
    model: nn.Module, ties: Sequence[TiedParameter], groups: Sequence[Any], same_layout: Sequence[bool] | None = None
) -> None:
    """Give every copy of each tied parameter the sum of all copies' gradients: the copies on this rank are added
    up, then summed over the tie's group. Call on every rank after backward, before clipping.

    ``same_layout`` (from :func:`tied_layouts_agree`) lets copies laid out alike sum their local shards; without it,
    or where layouts differ, whole tensors are summed (DTensor gradients are gathered over their mesh first)."""
    for index, (tie, group) in enumerate(zip(ties, groups)):
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
        shard_gradients_like_parameters(copies)  # torch returns a sharded embedding's gradient replicated
        if same_layout is not None and same_layout[index]:
            total = copies[0].grad
            for param in copies[1:]:
                total = total + param.grad
            if group is not None:
                dist.all_reduce(_local(total), op=dist.ReduceOp.SUM, group=group)
            for param in copies:
                param.grad.copy_(total)
            continue
        whole = _whole(copies[0].grad).clone()
        for param in copies[1:]:
            whole += _whole(param.grad)
        if group is not None:
            dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=group)
        for param in copies:
            _local(param.grad).copy_(_slice_like(whole, param))


def broadcast_tied_parameters(
    model: nn.Module, ties: Sequence[TiedParameter], groups: Sequence[Any], same_layout: Sequence[bool] | None = None
) -> None:
    """Make every copy equal to the first copy on the lowest holder rank (after materialising or loading).
    ``same_layout`` as in :func:`all_reduce_tied_gradients`."""
    for index, (tie, group) in enumerate(zip(ties, groups)):
        copies = _local_copies(model, tie)
        if not copies:
            continue
        with torch.no_grad():
            if same_layout is not None and same_layout[index]:
                source = copies[0].data
                if group is not None:
                    dist.broadcast(_local(source), group=group, group_src=0)
                for param in copies[1:]:
                    param.copy_(source)
                continue
            whole = _whole(copies[0].data).contiguous()
            if group is not None:
                dist.broadcast(whole, group=group, group_src=0)
            for param in copies:
                _local(param.data).copy_(_slice_like(whole, param))


def _layout(param: torch.Tensor) -> tuple:
    if isinstance(param, DTensor):
        placements = tuple(repr(p) for p in param.placements)
        return ("dtensor", tuple(param.device_mesh.shape), placements, tuple(param.to_local().shape))
    return ("tensor", tuple(param.shape))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective over a DTensor's mesh: every rank of this stage calls it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _slice_like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` in ``param``'s layout (a local slice, no communication)."""
    if not isinstance(param, DTensor):
        return whole
    return distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()


def _parameter(model: nn.Module, name: str) -> nn.Parameter | None:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def _local_copies(model: nn.Module, tie: TiedParameter) -> list[nn.Parameter]:
    """The distinct Parameter objects this rank holds for ``tie``, in name order."""
    found: list[nn.Parameter] = []
    for name in tie.names:
        param = _parameter(model, name)
        if param is not None and all(param is not p for p in found):
            found.append(param)
    return found


def _stage_of_param(plan: StagePlan, name: str) -> int:
    for index, units in enumerate(plan.stages):
        if any(name.startswith(f"{u}.") for u in units):
            return index
    raise ValueError(f"Parameter {name} is in no pipeline unit.")
