"""The gradient all-reduce across replica groups: each rank's gradient shards averaged with the same rank of every
other live group, through torchft's reconfigurable process group.

Under FSDP2 it runs during backward (:func:`reduce_in_backward`): each unit's reduce-scatter output goes through
torchft's all-reduce in FSDP2's all-reduce hook, where HSDP would all-reduce it over its replicate group, while
autograd goes on with the units before it; no copy of the gradients is made. Otherwise (no FSDP2 unit holds the
parameters: pure tensor or pipeline parallel groups) one flat buffer per dtype and device is all-reduced after the
backward (:func:`allreduce_gradients`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import Module


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of ``tensor`` (the local shard of a DTensor, which shares its storage)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def allreduce_gradients(manager: Any, parameters: Iterable[Tensor]) -> int:
    """Average the gradients of ``parameters`` over the groups in the current quorum (``manager``: torchft's
    ``Manager``), in place. Parameters without a gradient take part with zeros, so that every group issues the
    same collectives; they get the average only where it is not zero. Returns the bytes all-reduced.

    A failure (a group died mid-collective) is not raised: torchft records it and the step's commit says no."""
    entries = [(p, local_tensor(p.grad) if p.grad is not None else None) for p in parameters]
    buckets: dict[tuple[torch.dtype, torch.device], list[tuple[Tensor, Tensor | None]]] = {}
    for param, grad in entries:
        local = local_tensor(param)
        buckets.setdefault((local.dtype, local.device), []).append((param, grad))
    sent = 0
    for (dtype, _), members in buckets.items():
        flat = torch.cat(
            [
                (grad if grad is not None else torch.zeros_like(local_tensor(param))).reshape(-1).to(dtype)
                for param, grad in members
            ]
        )
        manager.allreduce(flat).wait()
        sent += flat.numel() * flat.element_size()
        offset = 0
        for param, grad in members:
            size = (grad if grad is not None else local_tensor(param)).numel()  # a gradient may be laid out otherwise
            part = flat[offset : offset + size]
            offset += size
            if grad is not None:
                grad.copy_(part.view_as(grad))
            elif bool(part.any()):
                shaped = part.view_as(local_tensor(param)).clone()
                param.grad = (
                    DTensor.from_local(
                        shaped, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                    )
                    if isinstance(param, DTensor)
                    else shaped
                )
    return sent


class BackwardReduce:
    """The all-reduce hook of every FSDP2 unit of a model: the unit's reduced gradient shards averaged over the
    groups of the current quorum, in place, before FSDP2 hands them to the parameters. ``sent`` counts the bytes.

    A failure (a group died mid-collective) is not raised: torchft records it and the step's commit says no."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.sent = 0

    def __call__(self, reduce_output: Tensor) -> None:
        self.manager.allreduce(reduce_output).wait()
        self.sent += reduce_output.numel() * reduce_output.element_size()


def reduce_in_backward(manager: Any, model: Module) -> BackwardReduce | None:
    """Install :class:`BackwardReduce` as the all-reduce hook of every FSDP2 unit of ``model``, when those units hold
    every trainable parameter; ``None`` (nothing installed) otherwise, or where FSDP2 refuses a hook (a unit with
    several parameter groups)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not units or not all(isinstance(p, DTensor) for p in trainable):
        return None
    hook = BackwardReduce(manager)
    try:
        for unit in units:
            unit.set_all_reduce_hook(hook)
    except ValueError:  # FSDP2: "not supported with multiple param groups"
        for unit in units:
            unit.set_all_reduce_hook(None)  # type: ignore[arg-type]
        return None
    return hook
