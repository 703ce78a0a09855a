"""Global-norm gradient clipping for a mix of DTensor (sharded on any mesh) and plain gradients."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

# Set on a parameter whose gradient another parameter already counts in the norm: the later pipeline stages' copies
# of a weight tied across stages (their gradients are equal after the tie's sum; one process counts it once).
_COUNTED_ELSEWHERE = "_lightning_dist_norm_counted_elsewhere"


# Set on a parameter that only some ranks hold, to the process group over whose ranks the parameters of its kind are
# split (the experts a rank keeps of a ModuleList, under expert parallelism): those gradients' norm (over their own
# mesh first, for a DTensor) is summed over that group instead of being taken as replicated.
_SPLIT_OVER = "_lightning_dist_norm_split_over"


def count_in_norm_elsewhere(param: Tensor) -> None:
    """Leave ``param``'s gradient out of :func:`total_grad_norm` (clipping still scales it)."""
    setattr(param, _COUNTED_ELSEWHERE, True)


def count_in_norm_split_over(param: Tensor, group: dist.ProcessGroup) -> None:
    """Count ``param`` in :func:`total_grad_norm` as one piece of a set of parameters split over the ranks of
    ``group``: each rank holds different ones, so their norms are summed over the group."""
    setattr(param, _SPLIT_OVER, group)


def total_grad_norm(
    parameters: Iterable[Tensor], norm_type: float = 2.0, stage_group: dist.ProcessGroup | None = None
) -> Tensor:
    """Norm of all gradients as if they were one unsharded vector.

    Gradients are grouped by device mesh; each group's norm is computed with DTensor semantics (shards summed
    across their mesh dims, replicas counted once) and the groups are combined locally. Plain tensors are
    treated as replicated on every rank. With ``stage_group`` (pipeline stages holding different parameters), the
    stages' norms are combined too, so every stage clips by the same coefficient. Parameters marked with
    :func:`count_in_norm_elsewhere` (copies of a tied weight) are left out.
    """
    local = _local_total_norm(parameters, float(norm_type))
    if stage_group is None:
        return local
    return _combine_over(local, float(norm_type), stage_group)


def _combine_over(norm: Tensor, norm_type: float, group: dist.ProcessGroup) -> Tensor:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else norm.device
    # In fp64 on every rank: a rank without gradients (a pipeline stage with nothing to train) has a float32 zero
    # where the others have their gradients' dtype, and a collective over mixed dtypes fails (or reads garbage).
    value = norm.to(device, torch.float64)
    if math.isinf(norm_type):
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value.to(norm.dtype)
    value = value.pow(norm_type)
    dist.all_reduce(value, group=group)
    return value.pow(1.0 / norm_type).to(norm.dtype)


def _local_total_norm(parameters: Iterable[Tensor], norm_type: float) -> Tensor:
    groups: dict[object, list[Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None and not getattr(p, _COUNTED_ELSEWHERE, False):
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups[(mesh, getattr(p, _SPLIT_OVER, None))].append(p.grad)
    if not groups:
        return torch.tensor(0.0)
    group_norms = []
    for (_, split_over), grads in groups.items():
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
        group_norm = torch.linalg.vector_norm(norms, norm_type)
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()
        if split_over is not None:
            group_norm = _combine_over(group_norm, norm_type, split_over)
        # Accumulate in at least fp32, and in fp64 when the gradients are fp64.
        group_norms.append(group_norm if group_norm.dtype == torch.float64 else group_norm.float())
    device = group_norms[0].device
    dtype = torch.promote_types(torch.float32, max((n.dtype for n in group_norms), key=lambda d: d.itemsize))
    return torch.linalg.vector_norm(torch.stack([n.to(device, dtype) for n in group_norms]), norm_type)


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    stage_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Scale gradients in place so their global norm (over ``stage_group`` too, see :func:`total_grad_norm`) is at
    most ``max_norm``; returns the norm before clipping."""
    parameters = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(parameters, norm_type, stage_group)
    if math.isinf(norm_type) or torch.isfinite(total):
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in parameters:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(clip_coef.to(device=grad.device, dtype=grad.dtype))
    return total


def clip_grad_value_(parameters: Iterable[Tensor], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]``, DTensor gradients included.

    Elementwise, so clamping each rank's local shard is exact; a partial (not yet summed) gradient is summed first,
    since clamping its addends would not clamp the sum. (``torch.nn.utils.clip_grad_value_`` fails on a mix of
    plain and DTensor gradients.)
    """
    for p in parameters:
        if p.grad is None:
            continue
        sum_partial_gradient(p)
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        grad.clamp_(-clip_value, clip_value)


def sum_partial_gradient(param: Tensor) -> bool:
    """Make a partial (not yet summed over its mesh) DTensor gradient whole, in place; returns whether it was
    partial. The summed gradient is the same on every rank of that mesh."""
    grad = param.grad
    if not isinstance(grad, DTensor) or not any(pl.is_partial() for pl in grad.placements):
        return False
    param.grad = grad.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in grad.placements])
    return True
