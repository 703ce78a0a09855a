"""The ``float8`` option: its recipes, what hardware each needs, and the layers it can convert. Pure PyTorch.

=============  ==========================================  =============================  ==================
recipe         what is FP8                                  FSDP2 all-gather               hardware (CUDA)
=============  ==========================================  =============================  ==================
``rowwise``    the three matmuls of each converted linear,  base precision (fp32/bf16)     SM89+ (H100, L40S)
               one scale per row (better numerics)
``tensorwise`` the same, one scale per tensor               FP8 weights (half of bf16)     SM89+
``mxfp8``      the same, one scale per 32 elements          base precision                 SM100+ (B200)
=============  ==========================================  =============================  ==================

On the CPU every recipe runs emulated (FP8 rounding, matmuls in the base precision): a numerics check, not a
speed-up.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

Float8Recipe = Literal["rowwise", "tensorwise", "mxfp8"]
RECIPES: tuple[str, ...] = get_args(Float8Recipe)

#: The smallest CUDA compute capability with FP8 matmul kernels for each recipe.
MIN_CAPABILITY: dict[str, tuple[int, int]] = {"rowwise": (8, 9), "tensorwise": (8, 9), "mxfp8": (10, 0)}
#: Both dimensions of a converted ``nn.Linear`` must be multiples of this (FP8 kernels' tile; MX's block size).
DIM_MULTIPLE: dict[str, int] = {"rowwise": 16, "tensorwise": 16, "mxfp8": 32}


def check_float8_recipe(recipe: object) -> Float8Recipe | None:
    """``recipe`` when it is one of :data:`RECIPES` or ``None``; a ``ValueError`` naming them otherwise."""
    if recipe is None or recipe in RECIPES:
        return recipe  # type: ignore[return-value]
    raise ValueError(
        f"float8={recipe!r} is not a float8 recipe. Use one of {list(RECIPES)} (or null for no FP8): 'rowwise'"
        " (one scale per row, the most accurate), 'tensorwise' (one scale per tensor, FP8 all-gather under FSDP2),"
        " 'mxfp8' (one scale per 32 elements, B200 and newer)."
    )


def check_float8_skip(skip: object) -> tuple[str, ...]:
    """The ``float8_skip`` option as a tuple of patterns: one string or a list of them, each a qualified module name
    or a regex matched against the whole name (``"blocks\\.0\\..*"``)."""
    if skip is None:
        return ()
    patterns = (skip,) if isinstance(skip, str) else tuple(skip) if isinstance(skip, (list, tuple, set)) else None
    if patterns is None or not all(isinstance(p, str) for p in patterns):
        raise TypeError(
            f"float8_skip={skip!r}: expected a module name or regex, or a list of them (e.g. ['head', 'blocks\\.0\\..*'])."
        )
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(f"float8_skip: {pattern!r} is not a valid regex ({error}).") from None
    return patterns


def float8_emulation(recipe: Float8Recipe, device_type: str, capability: tuple[int, int] | None) -> bool:
    """Whether ``recipe`` runs emulated on this device: yes on the CPU; no on CUDA with at least
    :data:`MIN_CAPABILITY`; a ``ValueError`` saying what is needed on an older GPU or another accelerator."""
    if device_type == "cpu":
        return True
    needed = MIN_CAPABILITY[recipe]
    if device_type != "cuda" or capability is None:
        raise ValueError(f"float8={recipe!r} runs on CUDA GPUs (or emulated on the CPU), not on {device_type!r}.")
    if capability < needed:
        gpus = "B200 or newer" if recipe == "mxfp8" else "H100, H200, L40S, RTX 4090 or newer"
        other = " Use float8='rowwise' or 'tensorwise' on SM89/SM90 GPUs (H100)." if recipe == "mxfp8" else ""
        raise ValueError(
            f"float8={recipe!r} needs FP8 matmuls, which need a GPU of compute capability"
            f" {needed[0]}.{needed[1]} or newer ({gpus}); this GPU is {capability[0]}.{capability[1]}.{other}"
            " Drop float8 (use precision='bf16-mixed') on this GPU."
        )
    return False
