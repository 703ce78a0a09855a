"""Walking the nested values a model takes and returns (tensors inside tuples, lists, dicts, Hugging Face outputs).

Pipeline stages may only pass flat tuples of tensors, while a user's forward returns whatever it likes (a logits
tensor, a ``CausalLMOutput``). These helpers flatten such a value into its tensors plus a recipe to rebuild it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OutputRecipe:
    """How to rebuild a nested value from its tensors: the value with every tensor replaced by ``_Slot(i)``."""

    skeleton: Any


@dataclass(frozen=True)
class _Slot:
    index: int


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor ``t`` inside it replaced by ``fn(t)`` (containers are rebuilt, not mutated)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        items = {k: map_tensors(v, fn) for k, v in value.items()}
        return _rebuild_mapping(value, items)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # named tuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value``, in a fixed traversal order."""
    found: list[torch.Tensor] = []
    map_tensors(value, lambda t: found.append(t))
    return found


def flatten_output(value: Any) -> tuple[tuple[torch.Tensor, ...], OutputRecipe]:
    """Split ``value`` into its tensors and the recipe that puts them back."""
    tensors: list[torch.Tensor] = []

    def slot(t: torch.Tensor) -> _Slot:
        tensors.append(t)
        return _Slot(len(tensors) - 1)

    recipe = OutputRecipe(map_tensors(value, slot))
    return tuple(tensors), recipe


def rebuild_output(tensors: tuple[torch.Tensor, ...] | torch.Tensor, recipe: OutputRecipe) -> Any:
    """Inverse of :func:`flatten_output`."""
    flat = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    return _fill(recipe.skeleton, flat)


def _fill(value: Any, flat: tuple[torch.Tensor, ...]) -> Any:
    if isinstance(value, _Slot):
        return flat[value.index]
    if isinstance(value, dict):
        return _rebuild_mapping(value, {k: _fill(v, flat) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_fill(v, flat) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_fill(v, flat) for v in value)
    return value


def _rebuild_mapping(original: dict, items: dict) -> dict:
    # Hugging Face ModelOutput subclasses are dataclasses built from keyword arguments; plain dicts take items.
    if type(original) is dict:
        return items
    try:
        return type(original)(**items)
    except TypeError:
        return type(original)(items)
