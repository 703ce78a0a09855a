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

AccumulationSync = Literal["every", "last", "replicas_last"]
ACCUMULATION_SYNC_MODES: tuple[str, ...] = ("every", "last", "replicas_last")


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
