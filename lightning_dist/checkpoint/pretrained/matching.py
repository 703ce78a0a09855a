"""Which tensor of a model each key of a pretrained file loads into, decided from names and shapes alone.

The pretrained model usually sits inside the module being trained (``self.model``, ``self.net.model``): its prefix is
the one under which the most of the file's keys name a parameter or persistent buffer of the module. Under that prefix
every parameter and persistent buffer must be loaded and every key of the file must be used; non-persistent buffers
(the rotary ``inv_freq``) are never in files and stay what the model's own init made them. Tied weights (GPT-2's
``lm_head.weight`` and ``transformer.wte.weight``) are one tensor loaded once from whichever of their names the file
holds, so they stay tied. Sharded parameters (DTensors) are matched by their full shapes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.pretrained.files import PretrainedFiles
from lightning_dist.compat import non_persistent_buffer_names

SHOWN = 5  # how many names each refusal lists


@dataclass(frozen=True)
class KeyMatch:
    """The outcome of matching: the prefix of the pretrained submodule, each file key's target tensor (one per tied
    group), the other names of tied targets, and the model's state outside the prefix (left as it is)."""

    prefix: str
    targets: dict[str, torch.Tensor]
    tied: dict[str, tuple[str, ...]]
    outside_prefix: tuple[str, ...]


def match_keys(model: nn.Module, files: PretrainedFiles, prefix: str | None = None) -> KeyMatch:
    """Match ``files`` to ``model``'s parameters and persistent buffers (``prefix`` found when ``None``); a
    :class:`CheckpointError` listing every problem (unused keys, unloaded state, shapes, dtypes, meta tensors) before
    anything is read."""
    groups = _state_groups(model)
    keys = set(files.tensors)
    if prefix is None:
        prefix = find_prefix([name for names, _ in groups for name in names], keys, files)
    elif prefix and not prefix.endswith("."):
        prefix += "."
    targets: dict[str, torch.Tensor] = {}
    tied: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    unloaded, outside = [], []
    for names, tensor in groups:
        relative = [name[len(prefix) :] for name in names if name.startswith(prefix)]
        if not relative:
            outside.append(names[0])
            continue
        held = [name for name in relative if name in keys]
        if not held:
            unloaded.append(prefix + relative[0])
            continue
        targets[held[0]] = tensor
        used.update(held)
        if len(relative) > 1:
            tied[held[0]] = tuple(name for name in relative if name != held[0])
    ignored = {name[len(prefix) :] for name in _non_persistent_buffer_names(model) if name.startswith(prefix)}
    unused = sorted(keys - used - ignored)
    _refuse_problems(files, prefix, targets, unused, unloaded)
    return KeyMatch(prefix, targets, tied, tuple(outside))


def find_prefix(model_names: list[str], keys: set[str], files: PretrainedFiles) -> str:
    """The prefix (``""``, ``"model."``, ``"net.model."``) under which the most of ``keys`` name model state."""
    counts: Counter[str] = Counter()
    for name in model_names:
        parts = name.split(".")
        for start in range(len(parts)):
            if ".".join(parts[start:]) in keys:
                counts["".join(part + "." for part in parts[:start])] += 1
    if not counts:
        raise CheckpointError(
            f"Pretrained weights {str(files.path)!r} do not fit this model: none of the file's keys is a parameter name"
            f" of the model, under any prefix. The file has {_first(sorted(keys))}; the model has"
            f" {_first(model_names)}. Is it a checkpoint of another model?"
        )
    best = max(counts.values())
    winners = sorted(name for name, count in counts.items() if count == best)
    if len(winners) > 1:
        shown = ", ".join(repr(name) for name in winners[:SHOWN])
        raise CheckpointError(
            f"Pretrained weights {str(files.path)!r} fit several submodules of the model equally well ({shown}): pass"
            " the prefix of the one to load."
        )
    return winners[0]


def _state_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The parameters and persistent buffers, one entry per tensor with all its names (tied weights have several)."""
    transient = _non_persistent_buffer_names(model)
    by_tensor: dict[int, tuple[list[str], torch.Tensor]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if name not in transient:
            by_tensor.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(by_tensor.values())


def _non_persistent_buffer_names(model: nn.Module) -> set[str]:
    return {
        f"{path}.{name}" if path else name
        for path, module in model.named_modules(remove_duplicate=False)
        for name in non_persistent_buffer_names(module)
    }


def _refuse_problems(
    files: PretrainedFiles, prefix: str, targets: dict[str, torch.Tensor], unused: list[str], unloaded: list[str]
) -> None:
    problems = []
    if unused:
        problems.append(f"{len(unused)} keys of the file are not in the model: {_first(unused)}")
    if unloaded:
        problems.append(f"{len(unloaded)} parameters or buffers of the model are not in the file: {_first(unloaded)}")
    shapes = [
        f"{key} (file {list(files.tensors[key].shape)}, model {list(tensor.shape)})"
        for key, tensor in targets.items()
        if tuple(tensor.shape) != files.tensors[key].shape
    ]
    if shapes:
        problems.append(f"{len(shapes)} shapes differ: {_first(shapes)}")
    kinds = [
        f"{key} (file {files.tensors[key].dtype}, model {tensor.dtype})"
        for key, tensor in targets.items()
        if _kind(files.tensors[key].dtype) != _kind(tensor.dtype)
    ]
    if kinds:
        problems.append(f"{len(kinds)} dtypes cannot be converted (floating point and integer differ): {_first(kinds)}")
    meta = [key for key, tensor in targets.items() if tensor.device.type == "meta"]
    if meta:
        problems.append(
            f"{len(meta)} tensors are still on the meta device (materialize the model first): {_first(meta)}"
        )
    if problems:
        where = f" (the pretrained model at prefix {prefix!r})" if prefix else ""
        raise CheckpointError(
            f"Pretrained weights {str(files.path)!r} do not fit this model{where}; nothing was loaded:\n- "
            + "\n- ".join(problems)
        )


def _kind(dtype: torch.dtype) -> str:
    return "float" if dtype.is_floating_point else "bool" if dtype == torch.bool else "int"


def _first(names: list[str]) -> str:
    more = f" (and {len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more
