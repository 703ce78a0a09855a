"""The checkpoint's names of a pretrained model's tensors: the LightningModule attribute prefix (``model.``,
``net.model.``) found by matching the checkpoint's keys against the model's own, and checked strictly."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lightning_dist.checkpoint.errors import CheckpointError

_SHOWN = 5


def find_prefix(checkpoint_names: Iterable[str], model_names: Iterable[str]) -> str:
    """The prefix ``p`` for which ``p + name`` is in the checkpoint for the most of the model's names (on a tie, the
    shortest), e.g. ``model.`` for ``self.model = LlamaForCausalLM(...)``."""
    checkpoint_names, model_names = set(checkpoint_names), list(model_names)
    counts: dict[str, int] = {}
    for key in checkpoint_names:
        for name in model_names:
            if key.endswith(name) and (len(key) == len(name) or key[-len(name) - 1] == "."):
                prefix = key[: len(key) - len(name)]
                counts[prefix] = counts.get(prefix, 0) + 1
    if not counts:
        raise CheckpointError(
            "None of the checkpoint's tensor names ends with a name of the model's (such as"
            f" {model_names[:2]}): is the config that of the trained model?"
        )
    return max(counts, key=lambda p: (counts[p], -len(p)))


def map_names(
    checkpoint_specs: dict[str, tuple[torch.Size, torch.dtype]],
    model_specs: dict[str, torch.Size],
    prefix: str,
    optional: Iterable[str] = (),
) -> dict[str, str]:
    """``{model name: checkpoint name}`` for every model tensor, the checkpoint's names being ``prefix + name``. Raises
    a :class:`CheckpointError` listing the first few missing and unexpected names (under ``prefix``) and any shape
    mismatch; ``optional`` model names (tied copies) may be absent."""
    under = {key[len(prefix) :]: key for key in checkpoint_specs if key.startswith(prefix)}
    missing = [n for n in model_specs if n not in under and n not in set(optional)]
    unexpected = [n for n in under if n not in model_specs]
    problems = []
    if missing:
        problems.append(f"{len(missing)} of the model's tensors are not in it under {prefix!r}: {_first(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors under {prefix!r} are not the model's: {_first(unexpected)}")
    shapes = [
        f"{n}: {tuple(checkpoint_specs[under[n]][0])} in the checkpoint, {tuple(shape)} in the model"
        for n, shape in model_specs.items()
        if n in under and tuple(checkpoint_specs[under[n]][0]) != tuple(shape)
    ]
    if shapes:
        problems.append(f"{len(shapes)} shapes differ: {_first(shapes)}")
    if problems:
        raise CheckpointError(
            "The checkpoint does not hold this model's weights: " + "; ".join(problems) + ". Give the prefix of the"
            " model's attribute in the LightningModule (--prefix, e.g. 'model.') or the config it was trained with"
            " (--config)."
        )
    return {n: under[n] for n in model_specs if n in under}


def _first(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
