"""FP8 training through torchao (the ``float8`` option): which file holds what.

* :mod:`.recipes`: the recipes, the hardware each needs (emulated on the CPU), the ``float8_skip`` patterns;
* :mod:`.convert`: choosing and converting the ``nn.Linear`` layers before any parallelism, and its log line;
* :mod:`.scales`: FSDP2's float8 all-gather scales, precomputed after each optimizer step.

torchao itself is reached through :mod:`lightning_dist.compat.torchao` only. Pure PyTorch, no Lightning.
"""

from lightning_dist.parallel.float8.convert import Float8Record, Float8Settings, convert_to_float8, float8_choice
from lightning_dist.parallel.float8.recipes import (
    DIM_MULTIPLE,
    MIN_CAPABILITY,
    RECIPES,
    Float8Recipe,
    check_float8_recipe,
    check_float8_skip,
    float8_emulation,
)
from lightning_dist.parallel.float8.scales import precompute_float8_scales, uses_float8_all_gather

__all__ = [
    "DIM_MULTIPLE",
    "MIN_CAPABILITY",
    "RECIPES",
    "Float8Recipe",
    "Float8Record",
    "Float8Settings",
    "check_float8_recipe",
    "check_float8_skip",
    "convert_to_float8",
    "float8_choice",
    "float8_emulation",
    "precompute_float8_scales",
    "uses_float8_all_gather",
]
