"""lightning_dist: parallelism strategies for PyTorch Lightning that need no model changes.

Importing the package registers its strategy names with ``lightning.pytorch``'s ``StrategyRegistry`` and with
Fabric's (:mod:`lightning_dist.fabric`)::

    import lightning as L
    import lightning_dist  # noqa: F401  (registers "fsdp2", ...)

    trainer = L.Trainer(strategy="fsdp2", devices=4)
"""

from lightning_dist.callbacks import ExportAtFitEnd, MeshThroughputMonitor
from lightning_dist.compat import warn_if_untested_torch
from lightning_dist.fabric import register_fabric_strategies
from lightning_dist.plugins import (
    AsyncDistributedCheckpointIO,
    CheckpointError,
    DistributedCheckpointIO,
    FSDP2Precision,
    FullStateCheckpointIO,
    ZeroPPPrecision,
)
from lightning_dist.plugins.folder_loading import register_folder_loading
from lightning_dist.strategies import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    MeshParallelStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
)
from lightning_dist.strategies.registry import register_strategies
from lightning_dist.version import __version__

__all__ = [
    "AsyncDistributedCheckpointIO",
    "CheckpointError",
    "ContextParallelStrategy",
    "DistributedCheckpointIO",
    "ExportAtFitEnd",
    "FSDP2Precision",
    "FSDP2Strategy",
    "FullStateCheckpointIO",
    "Hybrid3DStrategy",
    "MeshParallelStrategy",
    "MeshThroughputMonitor",
    "PipelineStrategy",
    "TensorParallelStrategy",
    "VerifyReport",
    "ZeroPPPrecision",
    "ZeroPPStrategy",
    "__version__",
    "verify",
]

register_strategies()
register_fabric_strategies()
register_folder_loading()
warn_if_untested_torch()


def __getattr__(name: str) -> object:
    # lightning_dist.verify(...) and VerifyReport, imported on first use (they bring LightningCLI's parser along)
    if name in ("verify", "VerifyReport"):
        from lightning_dist import verification

        return getattr(verification, name)
    raise AttributeError(f"module 'lightning_dist' has no attribute {name!r}")
