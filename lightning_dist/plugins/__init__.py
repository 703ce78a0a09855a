"""Precision and checkpoint-IO plugins matching the lightning_dist strategies."""

from lightning_dist.plugins.checkpoint_io import CheckpointError, DistributedCheckpointIO
from lightning_dist.plugins.precision import FSDP2Precision
from lightning_dist.plugins.zeropp_precision import ZeroPPPrecision

__all__ = ["CheckpointError", "DistributedCheckpointIO", "FSDP2Precision", "ZeroPPPrecision"]
