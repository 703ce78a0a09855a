"""Memory accounting: bytes of model and optimizer state this rank holds, and peak process / CUDA memory.

``state_bytes`` counts *storages*, not tensors: a storage shared by several tensors (tied weights, FSDP2's padded
shard buffer, views) is counted once, at its full size, in the first category that reaches it (in the order
parameters, buffers, gradients, optimizer state). For a DTensor the local shard (``to_local()``) is counted, so the
result is what this rank holds, padding included.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

try:
    import resource
except ImportError:  # Windows
    resource = None  # type: ignore[assignment]

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["cuda_peak_memory_bytes", "peak_process_memory_bytes", "reset_cuda_peak_memory_stats", "state_bytes"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if DTensor is not None and isinstance(t, DTensor) else t


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[Any, int]:
    """Identify the storage behind ``t`` and its size; tensors without an accessible storage count their own bytes."""
    try:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):  # e.g. wrapper subclasses without storage
        return ("tensor", id(t)), t.numel() * t.element_size()
    if ptr == 0:  # meta / zero-size storages share address 0; tell them apart by tensor
        return ("tensor", id(t)), storage.nbytes()
    return (t.device, ptr), storage.nbytes()


def _count(tensors: Iterable[torch.Tensor], seen: set[Any]) -> int:
    total = 0
    for t in tensors:
        key, nbytes = _storage_key_and_bytes(_local(t))
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


def _optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterable[torch.Tensor]:
    for opt in optimizers:
        for per_param in opt.state.values():
            values = per_param.values() if isinstance(per_param, dict) else [per_param]
            yield from (v for v in values if isinstance(v, torch.Tensor))


def state_bytes(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """Bytes of parameters, buffers, gradients and optimizer state held by this rank.

    Args:
        model: The (possibly sharded) model.
        optimizers: Optimizers whose ``state`` to count (step counters included).

    Returns:
        ``{"parameters", "buffers", "gradients", "optimizer_state", "total"}`` in bytes. Each storage is counted
        once (see the module docstring).
    """
    seen: set[Any] = set()
    params = list(model.parameters())
    out = {
        "parameters": _count(params, seen),
        "buffers": _count(model.buffers(), seen),
        "gradients": _count((p.grad for p in params if p.grad is not None), seen),
        "optimizer_state": _count(_optimizer_tensors(optimizers), seen),
    }
    out["total"] = sum(out.values())
    return out


def peak_process_memory_bytes() -> int | None:
    """Peak resident set size of this process (``ru_maxrss``), in bytes; ``None`` where unsupported.

    Linux reports KiB, macOS bytes. The peak cannot be reset and includes everything the process ever touched
    (CUDA context host memory, imported libraries).
    """
    if resource is None:
        return None
    try:
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except OSError:
        return None
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def cuda_peak_memory_bytes(device: torch.device | int | None = None) -> dict[str, int] | None:
    """CUDA caching-allocator statistics of ``device`` in bytes, or ``None`` when CUDA is unavailable.

    Args:
        device: CUDA device (default: the current one).

    Returns:
        ``{"max_allocated", "max_reserved", "allocated", "reserved"}`` (peaks since the last
        :func:`reset_cuda_peak_memory_stats`), or ``None`` on a CPU-only machine.
    """
    if not torch.cuda.is_available():
        return None
    return {
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "max_reserved": torch.cuda.max_memory_reserved(device),
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
    }


def reset_cuda_peak_memory_stats(device: torch.device | int | None = None) -> None:
    """Reset the CUDA peak statistics of ``device``; does nothing when CUDA is unavailable."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)
