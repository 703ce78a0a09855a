"""Keeping state that several ranks hold a copy of bitwise identical on all of them.

Tensor parallelism leaves some parameters whole on every tp rank (position embeddings, norms, biases of row-wise
layers); HSDP keeps one copy of each shard per replica group. Nothing in torch makes those copies equal: DDP
broadcasts at setup, ``parallelize_module`` and ``fully_shard`` do not. Without a seed each rank initializes its own
values, and even with one, tp peers compute their copy's gradient from all-reduced activations whose rounding can
differ, so the copies drift apart step by step.

:func:`broadcast_replicated_state` copies every parameter and buffer from the first rank of each mesh axis it is
replicated over, once, after the model is parallelized. Expert weights split over ``ep`` (which borrows ranks from
dp_shard × cp) are replicated over the rest of the loss group, ``ep_replicas``: ``distribute_tensor`` makes them
equal within each ep group only, so they are broadcast over ``ep_replicas`` too (over dp_replicate only, where FSDP2
shards them over the rest, ``ep_fsdp``). :func:`average_replicated_gradients` averages the
gradients of parameters replicated over ``tp`` before each optimizer step, so the copies stay identical. (Gradients
over the data-parallel axes are reduced by FSDP2 itself; pipeline stages hold different parameters.)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_dist.parallel.expert_parallel.module_list import SPLIT_OVER_EP
from lightning_dist.parallel.grad_clip import sum_partial_gradient
from lightning_dist.parallel.mesh import DERIVED_GROUPS, MESH_AXES, ParallelMesh

# Axes a copy can be replicated over. Not pp: every stage holds different parameters.
_REPLICA_AXES = ("dp_replicate", "dp_shard", "cp", "tp")
# What a tensor split over ep is replicated over instead of dp_replicate/dp_shard/cp (the loss group less ep).
_EP, _EP_REPLICAS, _EP_FSDP = "ep", "ep_replicas", "ep_fsdp"
_BROADCAST_ORDER = (*_REPLICA_AXES, _EP_REPLICAS)
_UNKNOWN = "?"


def sharded_axes(tensor: Tensor) -> set[str]:
    """The world mesh axes ``tensor`` is split over (sharded or partial; empty for a plain tensor), and ``ep`` for the
    ``ModuleList`` experts a rank keeps under expert parallelism (other ranks hold other experts)."""
    held = {_EP} if getattr(tensor, SPLIT_OVER_EP, None) is not None else set()
    if not isinstance(tensor, DTensor):
        return held
    names = tensor.device_mesh.mesh_dim_names or ()
    axes: set[str] = held
    for name, placement in zip(names, tensor.placements):
        if isinstance(placement, Replicate):  # anything else splits (Shard, FSDP's _StridedShard, Partial)
            continue
        if name in DERIVED_GROUPS:
            axes.update(DERIVED_GROUPS[name])
        elif name in MESH_AXES or name in (_EP, _EP_FSDP):
            axes.add(name)
        else:
            axes.add(_UNKNOWN)
    return axes


def replica_axes(tensor: Tensor, mesh: ParallelMesh) -> list[str]:
    """The axes (of size > 1) over which every rank holds the same part of ``tensor``.

    A tensor on a mesh whose dims lightning_dist did not name is left alone (``[]``): its layout is not ours to
    judge.
    """
    split = sharded_axes(tensor)
    if _UNKNOWN in split:
        return []
    sizes = mesh.dims.as_dict()
    if _EP in split and _EP_FSDP in split:  # experts FSDP2 shards over ep_fsdp: whole again over HSDP's replicas
        return [axis for axis in ("dp_replicate", "tp") if sizes[axis] > 1]
    if _EP in split:  # expert weights: the same experts on every rank of ep_replicas (and of tp)
        replicas = [_EP_REPLICAS] if mesh[_EP_REPLICAS].size() > 1 else []
        return replicas + [axis for axis in ("tp",) if sizes[axis] > 1 and axis not in split]
    return [axis for axis in _REPLICA_AXES if sizes[axis] > 1 and axis not in split]


def broadcast_replicated_state(model: nn.Module, mesh: ParallelMesh) -> tuple[int, list[str]]:
    """Make every replicated parameter and buffer equal to the copy of the first rank of each replica axis.

    Collective over the whole mesh; returns the number of tensors that had at least one replica axis, and the axes
    broadcast over.
    """
    by_axis: dict[str, list[Tensor]] = defaultdict(list)
    count = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        axes = replica_axes(tensor, mesh)
        count += bool(axes)
        for axis in axes:
            by_axis[axis].append(_local(tensor))
    with torch.no_grad():
        for axis in _BROADCAST_ORDER:  # a fixed order: every rank issues the same collectives
            if axis in by_axis:
                _broadcast_flat(by_axis[axis], mesh[axis].get_group())
    return count, [axis for axis in _BROADCAST_ORDER if axis in by_axis]


def tp_replicated_parameters(model: nn.Module, mesh: ParallelMesh) -> list[nn.Parameter]:
    """The parameters every tp rank holds a whole copy of (of the same shard, under FSDP2): their gradients must
    be averaged over tp (:func:`average_gradients`)."""
    if mesh.dims.tp == 1:
        return []
    return [p for p in model.parameters() if p.requires_grad and "tp" in replica_axes(p, mesh)]


def average_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> int:
    """Average the gradients of ``parameters`` over ``group`` in one all-reduce per dtype; returns the bytes reduced.

    Call after the last backward of a step, before clipping and the optimizer step. Every rank receives the same
    reduced values (and divides them identically), so copies that were equal stay bitwise equal.
    """
    return _all_reduce_gradients(parameters, group, average=True)


def sum_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup) -> int:
    """Sum the gradients of ``parameters`` over ``group`` (each rank holds its part of the whole gradient: a
    per-head norm under tensor parallelism); otherwise as :func:`average_gradients`."""
    return _all_reduce_gradients(parameters, group, average=False)


@contextmanager
def gradients_set_aside(parameters: Iterable[nn.Parameter]) -> Iterator[None]:
    """Within it, ``parameters`` have no gradient, so a backward inside computes only its own part of it; on exit the
    gradients they had are added back. For gradients reduced once per backward (:func:`sum_gradients`, which must not
    sum what an earlier backward already summed) when several backwards accumulate into them."""
    earlier = [(p, p.grad) for p in parameters if p.grad is not None]
    for p, _ in earlier:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, grad in earlier:
                p.grad = grad if p.grad is None else grad.add_(p.grad)


def _all_reduce_gradients(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup, average: bool) -> int:
    # A partial gradient (sequence-parallel norms) is summed instead: that makes it whole and equal on every rank
    # already, while averaging its addends would divide it.
    grads = [_local(p.grad) for p in parameters if p.grad is not None and not sum_partial_gradient(p)]
    size = dist.get_world_size(group)
    reduced = 0
    with torch.no_grad():
        for flat, members in _flat_by_dtype(grads):
            flat = _on_collective_device(flat, group)
            dist.all_reduce(flat, group=group)
            if average:
                flat.div_(size)
            _scatter_back(flat, members)
            reduced += flat.nbytes
    return reduced


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _broadcast_flat(tensors: list[Tensor], group: dist.ProcessGroup) -> None:
    for flat, members in _flat_by_dtype(tensors):
        flat = _on_collective_device(flat, group)
        dist.broadcast(flat, group=group, group_src=0)
        _scatter_back(flat, members)


def _on_collective_device(flat: Tensor, group: dist.ProcessGroup) -> Tensor:
    """NCCL moves only GPU tensors: CPU-offloaded state travels through the current GPU."""
    if flat.device.type == "cpu" and dist.get_backend(group) == "nccl":
        return flat.to(torch.device("cuda", torch.cuda.current_device()))
    return flat


def _flat_by_dtype(tensors: list[Tensor]) -> list[tuple[Tensor, list[Tensor]]]:
    """One contiguous buffer per (dtype, device), so a group costs one collective per dtype, not one per tensor."""
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = defaultdict(list)
    for tensor in tensors:
        if tensor.numel():
            groups[(tensor.dtype, tensor.device)].append(tensor)
    return [(torch.cat([t.reshape(-1) for t in members]), members) for members in groups.values()]


def _scatter_back(flat: Tensor, members: list[Tensor]) -> None:
    offset = 0
    for tensor in members:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
