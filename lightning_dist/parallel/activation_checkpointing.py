"""Activation checkpointing of selected blocks without changing parameter names."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from lightning_dist.compat import composable_checkpoint


def apply_activation_checkpointing(blocks: Iterable[nn.Module]) -> int:
    """Recompute each block's activations in backward instead of storing them. Returns the number of blocks.

    Uses the composable (hook-based) API so state-dict keys stay the same as the unwrapped model's, which keeps
    checkpoints interchangeable between runs with and without activation checkpointing.
    """
    count = 0
    for block in blocks:
        composable_checkpoint(block)
        count += 1
    return count
