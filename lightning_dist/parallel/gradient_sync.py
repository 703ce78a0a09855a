"""When FSDP2 communicates gradients during gradient accumulation.

With ``accumulate_grad_batches=k`` the optimizer steps once per k micro-batches, but FSDP2 reduce-scatters (and,
under HSDP, all-reduces) every micro-batch's gradients by default. The modes:

* ``"every"``: reduce after each micro-batch; only sharded gradients are kept between micro-batches (lowest memory,
  k reduce-scatters per optimizer step).
* ``"last"``: no gradient communication until the last micro-batch; each rank accumulates the full, unsharded
  gradients of its units in between (1/k of the bytes, but gradient memory as large as DDP's).
* ``"replicas_last"`` (HSDP only): reduce-scatter inside the shard group after each micro-batch, all-reduce across
  the replica groups (usually across nodes) only after the last (sharded gradient memory, 1/k of the cross-replica
  bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from torch import nn

from lightning_dist.parallel.fsdp import fsdp_modules
from lightning_dist.parallel.mesh import MeshConfigError, ParallelDims

AccumulationSync = Literal["every", "last", "replicas_last"]
ACCUMULATION_SYNC_MODES: tuple[str, ...] = ("every", "last", "replicas_last")


def check_accumulation_sync(mode: str) -> AccumulationSync:
    """``mode`` if it is one of :data:`ACCUMULATION_SYNC_MODES`; a ``ValueError`` naming them otherwise."""
    if mode not in ACCUMULATION_SYNC_MODES:
        raise ValueError(f"accumulation_sync={mode!r} is not one of {list(ACCUMULATION_SYNC_MODES)}.")
    return mode  # type: ignore[return-value]


def check_accumulation_sync_mesh(mode: AccumulationSync, dims: ParallelDims) -> None:
    """Refuse a mode the mesh cannot honour: ``"replicas_last"`` without replica groups, and any deferral under
    pipeline parallelism (the schedule decides when a stage's FSDP2 units reduce their gradients)."""
    if mode == "replicas_last" and dims.dp_replicate == 1:
        raise MeshConfigError(
            "accumulation_sync='replicas_last' defers the all-reduce across replica groups, but this mesh has none"
            f" ({dims}). Use sharding='hybrid' (HSDP), or accumulation_sync='last' or 'every'."
        )
    if mode != "every" and dims.pp > 1:
        raise MeshConfigError(
            f"accumulation_sync={mode!r} cannot be combined with pipeline parallelism (pp={dims.pp}): the pipeline"
            " schedule decides when each stage reduces its gradients. Use accumulation_sync='every'."
        )


@contextmanager
def deferred_gradient_sync(model: nn.Module, mode: AccumulationSync) -> Iterator[None]:
    """Within the context (the backward of a non-final micro-batch), skip the communication ``mode`` defers."""
    modules = fsdp_modules(model) if mode != "every" else []
    for module in modules:
        _set(module, mode, False)
    try:
        yield
    finally:
        for module in modules:
            _set(module, mode, True)


def _set(module: nn.Module, mode: AccumulationSync, sync: bool) -> None:
    if mode == "last":
        module.set_requires_gradient_sync(sync, recurse=False)
    else:
        module.set_requires_all_reduce(sync, recurse=False)
