"""Converting a model's ``nn.Linear`` layers to torchao's FP8 linears, before any parallelism (torchtitan's order:
model converters, then pipeline split, tensor parallel, activation checkpointing, compile, FSDP2). Pure PyTorch.

Which layers: every ``nn.Linear`` whose two dimensions are multiples of :data:`~.recipes.DIM_MULTIPLE`, except the
output head (its logits feed the loss, where FP8 rounding costs the most accuracy; torchtitan skips it too) and the
layers ``float8_skip`` names; for mxfp8 also layers with a bias (torchao 0.18's MXFP8 linear computes ``x @ W.T``
and drops the bias: observed, the output differed by exactly the bias). Parameters keep their names and their dtype: master weights and optimizer state stay in
the base precision; only the matmuls (and, for tensorwise under FSDP2, the weight all-gather) are FP8.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from lightning_dist.compat.torchao import (
    convert_linears_to_float8,
    convert_linears_to_mxfp8,
    float8_linear_config,
    missing_torchao_message,
    mxfp8_config,
    torchao_version,
)
from lightning_dist.parallel.float8.recipes import DIM_MULTIPLE, Float8Recipe


@dataclass(frozen=True)
class Float8Settings:
    """How to convert a model.

    Attributes:
        recipe: ``"rowwise"``, ``"tensorwise"`` or ``"mxfp8"``.
        skip: Patterns of module names left in the base precision (each a full-match regex).
        emulate: FP8 rounding with matmuls in the base precision (CPU).
        fsdp_float8_all_gather: Tensorwise only: FSDP2 all-gathers the weights in FP8.
        head: The output head's name (skipped), if the model has one.
    """

    recipe: Float8Recipe
    skip: tuple[str, ...] = ()
    emulate: bool = False
    fsdp_float8_all_gather: bool = False
    head: str | None = None


@dataclass
class Float8Record:
    """What :func:`convert_to_float8` did: the converted layers and, for every other ``nn.Linear``, why not."""

    settings: Float8Settings
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One log line: how many layers were converted, which were skipped and why."""
        s = self.settings
        how = "emulated on the CPU: checks numerics only" if s.emulate else "FP8 matmuls"
        if s.fsdp_float8_all_gather:
            how += ", FP8 weight all-gather with scales precomputed after each optimizer step"
        skipped = "; ".join(f"{name} ({why})" for name, why in self.skipped.items()) or "none"
        return f"float8={s.recipe!r}: converted {len(self.converted)} nn.Linear layers ({how}); skipped: {skipped}"


def float8_choice(model: nn.Module, settings: Float8Settings) -> tuple[list[str], dict[str, str]]:
    """The ``nn.Linear`` layers of ``model`` to convert, and every other one with the reason it stays."""
    multiple = DIM_MULTIPLE[settings.recipe]
    converted, skipped = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        matched = next((p for p in settings.skip if re.fullmatch(p, name)), None)
        if matched is not None:
            skipped[name] = f"float8_skip {matched!r}"
        elif name == settings.head:
            skipped[name] = "output head"
        elif module.in_features % multiple or module.out_features % multiple:
            skipped[name] = f"{module.in_features}×{module.out_features} not multiples of {multiple}"
        elif settings.recipe == "mxfp8" and module.bias is not None:
            skipped[name] = "has a bias, which torchao 0.18's MXFP8 linear leaves out of its output"
        else:
            converted.append(name)
    return converted, skipped


def convert_to_float8(model: nn.Module, settings: Float8Settings) -> Float8Record:
    """Convert ``model``'s chosen linears in place (see :func:`float8_choice`); names and parameters are kept."""
    if torchao_version() is None:
        raise ModuleNotFoundError(missing_torchao_message(f"float8={settings.recipe!r}"))
    converted, skipped = float8_choice(model, settings)
    chosen = set(converted)
    ids = {id(m) for n, m in model.named_modules() if n in chosen}

    def keep(module: nn.Module, name: str) -> bool:
        return id(module) in ids

    if settings.recipe == "mxfp8":
        convert_linears_to_mxfp8(model, mxfp8_config(emulate=settings.emulate), keep)
    else:
        config = float8_linear_config(
            settings.recipe, emulate=settings.emulate, fsdp_float8_all_gather=settings.fsdp_float8_all_gather
        )
        convert_linears_to_float8(model, config, keep)
    return Float8Record(settings, converted, skipped)
