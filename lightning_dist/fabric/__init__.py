"""The lightning_dist strategies for Lightning Fabric: the same names, options and parallelisms as the Trainer's, for
loops written with ``fabric.setup`` / ``fabric.backward`` / ``fabric.save`` (litgpt's scripts among them).

``import lightning_dist`` registers the names with Fabric::

    import lightning as L
    import lightning_dist  # noqa: F401

    fabric = L.Fabric(strategy="fsdp2", devices=8)

or pass a class: ``L.Fabric(strategy=lightning_dist.fabric.TensorParallelStrategy(tensor_parallel_size=2))``.
See docs/fabric.md.
"""

from lightning_dist.fabric.precision import FabricMeshPrecision
from lightning_dist.fabric.registry import register_fabric_strategies
from lightning_dist.fabric.strategies import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
)
from lightning_dist.fabric.strategy import MeshFabricStrategy

__all__ = [
    "ContextParallelStrategy",
    "FSDP2Strategy",
    "FabricMeshPrecision",
    "Hybrid3DStrategy",
    "MeshFabricStrategy",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "ZeroPPStrategy",
    "register_fabric_strategies",
]
