"""Precision and checkpoint-IO plugins matching the lightning_dist strategies."""

from lightning_dist.plugins.async_checkpoint_io import AsyncDistributedCheckpointIO
from lightning_dist.plugins.checkpoint_io import CheckpointError, DistributedCheckpointIO, ParallelCheckpointIO
from lightning_dist.plugins.float8_precision import Float8Precision
from lightning_dist.plugins.full_state_checkpoint_io import FullStateCheckpointIO
from lightning_dist.plugins.precision import FSDP2Precision
from lightning_dist.plugins.zeropp_precision import ZeroPPPrecision

__all__ = [
    "AsyncDistributedCheckpointIO",
    "CheckpointError",
    "DistributedCheckpointIO",
    "FSDP2Precision",
    "Float8Precision",
    "FullStateCheckpointIO",
    "ParallelCheckpointIO",
    "ZeroPPPrecision",
]
