"""Checkpoint files in pure PyTorch (no Lightning): folder layout and atomic publishing, fit checks against a model,
optimizer-state formats, consolidation of sharded checkpoints and summaries for ``lightning-dist inspect``."""

from lightning_dist.checkpoint.layout import CheckpointError
from lightning_dist.checkpoint.validation import validate_checkpoint

__all__ = ["CheckpointError", "validate_checkpoint"]
