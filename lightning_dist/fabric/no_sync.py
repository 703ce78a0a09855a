"""``fabric.no_backward_sync(model)`` under the lightning_dist Fabric strategies: FSDP2 units keep their gradients
unreduced until the last micro-batch of an accumulation window."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from torch.distributed.fsdp import FSDPModule
from torch.nn import Module

from lightning_dist.compat.lightning import BackwardSyncControl


class ShardedNoSync(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: FSDP2 units keep their gradients unreduced until the last micro-batch."""

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        if not enabled or not units:
            return nullcontext()
        return _GradientSyncOff(units)


class _GradientSyncOff(AbstractContextManager):
    def __init__(self, units: list[FSDPModule]) -> None:
        self.units = units

    def __enter__(self) -> None:
        for unit in self.units:
            unit.set_requires_gradient_sync(False, recurse=False)

    def __exit__(self, *exc: object) -> None:
        for unit in self.units:
            unit.set_requires_gradient_sync(True, recurse=False)
