"""Applying FSDP2 (``fully_shard``) to a model: each selected block, then the root."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

ShardingMode = Literal["full", "grad_op", "no_shard", "hybrid"]
SHARDING_MODES: tuple[str, ...] = ("full", "grad_op", "no_shard", "hybrid")


@dataclass
class FSDPConfig:
    """How to shard: what ``fully_shard`` receives for every unit."""

    reshard_after_forward: bool | int = True
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    cpu_offload: bool = False

    @property
    def offload_policy(self) -> OffloadPolicy:
        return CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """All modules of ``model`` (itself included) that ``fully_shard`` was applied to."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_fully_sharded(model: nn.Module) -> bool:
    return bool(fsdp_modules(model))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: Iterable[nn.Module],
    config: FSDPConfig,
    root_mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Shard every block as its own communication group, then the root (which takes the remaining parameters).

    ``mesh`` is 1-D (fully sharded) or 2-D ``(replicate, shard)`` (HSDP). The root always keeps its parameters
    gathered from forward to the end of backward: its "forward" is the whole ``training_step``, which may call the
    model's ``forward`` again inside it, and backward needs the root's parameters first anyway.
    """
    # fully_shard must run bottom-up: a unit nested in another unit (a regex matching both) is sharded first.
    for block in sorted(blocks, key=_height):
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=config.mp_policy,
            offload_policy=config.offload_policy,
        )
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=False,
        mp_policy=root_mp_policy or config.mp_policy,
        offload_policy=config.offload_policy,
    )


def _height(module: nn.Module) -> int:
    """Levels of submodules below ``module``: a unit nested in another always has a smaller height."""
    return 1 + max((_height(child) for child in module.children()), default=0)


def reshard_all(model: nn.Module) -> None:
    """Return every FSDP unit to its sharded state.

    Needed before an optimizer step and after an evaluation loop when units may be left gathered (``grad_op``,
    an integer ``reshard_after_forward``, or a ``no_grad`` forward): otherwise the next forward could use the
    pre-step gathered weights.
    """
    for module in fsdp_modules(model):
        module.reshard()
