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


def turn_off_generation_cache(model: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` on every Hugging Face config in ``model`` that has it on; returns the names of
    the modules whose config changed.

    A decoder that fills a key/value cache during forward (T5's stack builds an ``EncoderDecoderCache`` whenever
    ``use_cache`` is on) saves different tensors when a checkpointed block is recomputed, and torch refuses the
    backward. transformers turns the cache off itself under its own gradient checkpointing; ours wraps the blocks
    from outside, so it must do the same. Generation afterwards can pass ``use_cache=True`` again.
    """
    changed, seen = [], set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or getattr(config, "use_cache", None) is not True:
            continue
        seen.add(id(config))
        config.use_cache = False
        changed.append(name or type(module).__name__)
    return changed
