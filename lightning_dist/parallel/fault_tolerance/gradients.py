"""The gradient all-reduce across replica groups: each rank's gradient shards averaged with the same rank of every
other live group, through torchft's reconfigurable process group (one flat buffer per dtype and device)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


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
