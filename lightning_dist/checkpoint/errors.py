"""The one exception every checkpoint check raises."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unfinished, corrupt, unsafe to unpickle, or does not match the model."""
