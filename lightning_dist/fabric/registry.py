"""The Fabric strategy names: the Trainer's names (:data:`~lightning_dist.strategies.registry.STRATEGY_NAMES`) with
the same presets, registered in Fabric's ``STRATEGY_REGISTRY`` by ``import lightning_dist``. The pipeline names are
registered too, to a class that says why Fabric cannot run them."""

from __future__ import annotations

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_dist.fabric.strategies import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
)
from lightning_dist.strategies import registry as trainer_registry

#: The Fabric class of each Trainer strategy class.
FABRIC_CLASSES: dict[type, type] = {
    trainer_registry.FSDP2Strategy: FSDP2Strategy,
    trainer_registry.ZeroPPStrategy: ZeroPPStrategy,
    trainer_registry.TensorParallelStrategy: TensorParallelStrategy,
    trainer_registry.ContextParallelStrategy: ContextParallelStrategy,
    trainer_registry.Hybrid3DStrategy: Hybrid3DStrategy,
    trainer_registry.PipelineStrategy: PipelineStrategy,
}


def register_fabric_strategies() -> None:
    """Register every name with Fabric; a second call (re-import) is a no-op. Fabric's own names are never
    overridden."""
    for name, trainer_class, description, presets in trainer_registry.STRATEGY_NAMES:
        fabric_class = FABRIC_CLASSES[trainer_class]
        if name in STRATEGY_REGISTRY:
            if STRATEGY_REGISTRY[name]["strategy"] is not fabric_class:
                raise RuntimeError(f"The Fabric strategy name {name!r} is already registered by another package.")
            continue
        STRATEGY_REGISTRY.register(name, fabric_class, description=description, **presets)
