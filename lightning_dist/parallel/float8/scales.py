"""FSDP2's float8 all-gather (``float8='tensorwise'``): each weight is cast to FP8 before it is all-gathered, with a
tensorwise scale. Computed per weight inside the all-gather, each scale costs an all-reduce of its amax; computed
for every weight at once after the optimizer step, one all-reduce serves them all (torchao's
``precompute_float8_dynamic_scale_for_fsdp``). The strategy calls :func:`precompute_float8_scales` after every
optimizer step; the user writes nothing. Pure PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from lightning_dist.compat.torchao import precompute_float8_scales as _precompute
from lightning_dist.parallel.float8.recipes import Float8Recipe


def uses_float8_all_gather(recipe: Float8Recipe | None, sharded: bool, custom_all_gather: bool = False) -> bool:
    """Whether FSDP2 all-gathers weights in FP8: tensorwise scaling (one scale per weight tensor, which FSDP2's
    tensor-subclass hooks can carry), over a data-parallel mesh, without a custom all-gather of its own."""
    return recipe == "tensorwise" and sharded and not custom_all_gather


def precompute_float8_scales(parts: Iterable[nn.Module]) -> None:
    """The FP8 scales of every float8-all-gathered weight in ``parts``, for the next forward (one all-reduce)."""
    for part in parts:
        _precompute(part)
