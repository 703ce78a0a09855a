"""Which tensor of a model's state each key of a pretrained file loads into, decided from names and shapes alone.

The state is the model's own ``get_model_state_dict`` (the form a checkpoint takes: a tensor-parallel fused
projection in its original row order, a pipeline stage's keys only). The pretrained model usually sits inside the
module being trained (``self.model``, ``self.net.model``): its prefix is the one under which the most of the file's
keys name a key of the state. Under that prefix every key of the state must be loaded and every key of the file
used (on a pipeline, by some stage: the caller joins the ranks' matches). Non-persistent buffers (the rotary
``inv_freq``) are in no state dict; a file that still carries one (older Hugging Face checkpoints saved
``rotary_emb.inv_freq``) has it skipped, and the model keeps what its own init computed. Tied weights (GPT-2's
``lm_head.weight`` and ``transformer.wte.weight``) are one tensor loaded once from whichever of their names the file
holds, so they stay tied; ``aliases`` names copies of a weight that are not one tensor (a pipeline's stages each hold
their own copy). Keys saved from a compiled module (``_orig_mod.``) match without it. Sharded tensors (DTensors) are
matched by their full shapes.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.pretrained.files import PretrainedFiles
from lightning_dist.checkpoint.pretrained.stacked import Renaming, StackedSource, Stacking, find_stacked, renamed_names

SHOWN = 5  # how many names each refusal lists
_COMPILED = "_orig_mod."
_LEGACY_TRANSIENT = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class KeyMatch:
    """The outcome of matching one rank's state.

    Attributes:
        prefix: The prefix of the pretrained submodule (``""``, ``"model."``).
        targets: Each file key (as the file spells it) → the tensor of the state it loads into, one per tied group.
        tied: The state keys loaded through another key's tensor or value: file key → those keys.
        copies: State keys that are other tensors than their file key's target (a pipeline's tied copies on one
            rank): state key → file key, filled from the file too.
        outside_prefix: The state outside the prefix (a new head), left as it is.
        used: The file keys this rank loads (targets' and copies').
        skipped: File keys loaded nowhere by design (non-persistent buffers).
        stacked: State keys of stacked experts parameters → the file's per-expert tensors they are made of.
        problems: What does not fit on this rank: ``"unloaded"``, ``"shapes"``, ``"dtypes"``, ``"meta"`` → lines.
    """

    prefix: str
    targets: dict[str, torch.Tensor]
    tied: dict[str, tuple[str, ...]]
    copies: dict[str, str]
    outside_prefix: tuple[str, ...]
    used: frozenset[str]
    skipped: frozenset[str]
    stacked: dict[str, StackedSource] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=dict)


def match_keys(
    state: Mapping[str, torch.Tensor],
    files: PretrainedFiles,
    prefix: str | None = None,
    aliases: Mapping[str, Sequence[str]] | None = None,
    transient: Iterable[str] = (),
    ties: Iterable[Sequence[str]] = (),
    allow_meta: bool = False,
    renamings: Sequence[Renaming] = (),
    stackings: Sequence[Stacking] = (),
) -> KeyMatch:
    """Match ``files`` to the tensors of ``state`` (``prefix`` found when ``None``). ``aliases``: state key → other
    names of the same weight the file may hold it under, as another tensor; ``transient``: the model's
    non-persistent buffer names; ``ties``: the names of each tensor registered under several (one tensor, loaded
    once); ``renamings`` and ``stackings``: how the model's own conversion table names weights on disk
    (:mod:`.stacked`). The problems found are returned, not raised: see :func:`refuse_problems`."""
    by_name = _file_keys_by_name(files)
    if prefix is None:
        prefix = find_prefix(list(state), set(by_name), files)
    elif prefix and not prefix.endswith("."):
        prefix += "."
    aliases = aliases or {}
    targets: dict[str, torch.Tensor] = {}
    tied: dict[str, list[str]] = {}
    copies: dict[str, str] = {}
    stacked: dict[str, StackedSource] = {}
    unloaded, outside = [], []
    for names, tensor in _groups(state, ties):
        relative = [name[len(prefix) :] for name in names if name.startswith(prefix)]
        if not relative:
            outside.append(names[0])
            continue
        candidates = [*relative, *(alias[len(prefix) :] for name in names for alias in aliases.get(name, ()))]
        candidates = [renamed for name in candidates for renamed in renamed_names(name, renamings)]
        held = [by_name[name] for name in candidates if name in by_name]
        if not held:
            source = find_stacked(relative[0], tensor.shape[0], by_name, renamings, stackings) if tensor.dim() else None
            if source is None:
                unloaded.append(prefix + relative[0])
            else:
                rows = tuple(tuple(by_name[key] for key in row) for row in source.keys)
                stacked[names[0]] = StackedSource(rows, source.concatenated)
            continue
        key = held[0]
        if key in targets:  # another tensor of the state loads from this key too: copied after the load
            copies.update({prefix + name: key for name in relative})
            continue
        targets[key] = tensor
        if len(relative) > 1:
            tied[key] = [name for name in relative if by_name.get(name) != key]
    skipped = {
        by_name[name[len(prefix) :]] for name in transient if name.startswith(prefix) and name[len(prefix) :] in by_name
    }
    skipped |= {key for key in files.tensors if _LEGACY_TRANSIENT.search(key)}
    match = KeyMatch(
        prefix,
        targets,
        {key: tuple(names) for key, names in tied.items()},
        copies,
        tuple(outside),
        frozenset(targets)
        | frozenset(copies.values())
        | {key for src in stacked.values() for row in src.keys for key in row},
        frozenset(skipped),
        stacked,
    )
    match.problems.update(_problems(files, match, state, unloaded, allow_meta))
    return match


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
            f" of the model, under any prefix. The file has {first(sorted(keys))}; the model has"
            f" {first(model_names)}. Is it a checkpoint of another model?"
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


def refuse_problems(files: PretrainedFiles, matches: Sequence[KeyMatch]) -> None:
    """Raise one :class:`CheckpointError` listing every problem of the ``matches`` (one per rank, or one), the file's
    keys no rank uses included, before anything is read; nothing when all fit."""
    prefixes = sorted({match.prefix for match in matches})
    if len(prefixes) > 1:
        raise CheckpointError(
            f"Pretrained weights {str(files.path)!r}: the ranks found the pretrained model at different prefixes"
            f" ({', '.join(map(repr, prefixes))}): pass the prefix."
        )
    used = set().union(*(match.used | match.skipped for match in matches))
    unused = sorted(key for key in files.tensors if key not in used)
    merged: dict[str, list[str]] = {}
    for match in matches:
        for kind, lines in match.problems.items():
            merged.setdefault(kind, [])
            merged[kind].extend(line for line in lines if line not in merged[kind])
    problems = []
    if unused:
        problems.append(f"{len(unused)} keys of the file are not in the model: {first(unused)}")
    if merged.get("unloaded"):
        lines = merged["unloaded"]
        problems.append(f"{len(lines)} parameters or buffers of the model are not in the file: {first(lines)}")
    if merged.get("shapes"):
        problems.append(f"{len(merged['shapes'])} shapes differ: {first(merged['shapes'])}")
    if merged.get("dtypes"):
        lines = merged["dtypes"]
        problems.append(f"{len(lines)} dtypes cannot be converted (floating point and integer differ): {first(lines)}")
    if merged.get("meta"):
        lines = merged["meta"]
        problems.append(
            f"{len(lines)} tensors are still on the meta device (materialize the model first): {first(lines)}"
        )
    if problems:
        where = f" (the pretrained model at prefix {prefixes[0]!r})" if prefixes[0] else ""
        raise CheckpointError(
            f"Pretrained weights {str(files.path)!r} do not fit this model{where}; nothing was loaded:\n- "
            + "\n- ".join(problems)
        )


def _file_keys_by_name(files: PretrainedFiles) -> dict[str, str]:
    """The name each file key matches the model under (``_orig_mod.`` removed) → the key as the file spells it."""
    return {key.replace(_COMPILED, ""): key for key in files.tensors}


def _groups(state: Mapping[str, torch.Tensor], ties: Iterable[Sequence[str]]) -> list[tuple[list[str], torch.Tensor]]:
    """The state's tensors, one entry per weight with all its names (tied weights have several): a state dict's
    values are new tensor objects, so ties are told by the names the model registered one tensor under."""
    first_name = {name: names[0] for names in ties for name in names}
    groups: dict[str, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            groups.setdefault(first_name.get(name, name), ([], tensor))[0].append(name)
    return list(groups.values())


def _problems(
    files: PretrainedFiles,
    match: KeyMatch,
    state: Mapping[str, torch.Tensor],
    unloaded: list[str],
    allow_meta: bool,
) -> dict[str, list[str]]:
    problems: dict[str, list[str]] = {}
    if unloaded:
        problems["unloaded"] = unloaded
    shapes = [
        f"{key} (file {list(files.tensors[key].shape)}, model {list(tensor.shape)})"
        for key, tensor in match.targets.items()
        if tuple(tensor.shape) != files.tensors[key].shape
    ]
    shapes += [
        f"{name} (file {list(source.shape(files))} from {len(source.keys)} experts, model {list(state[name].shape)})"
        for name, source in match.stacked.items()
        if source.shape(files) != tuple(state[name].shape)
    ]
    if shapes:
        problems["shapes"] = shapes
    kinds = [
        f"{key} (file {files.tensors[key].dtype}, model {tensor.dtype})"
        for key, tensor in match.targets.items()
        if _kind(files.tensors[key].dtype) != _kind(tensor.dtype)
    ]
    kinds += [
        f"{name} (file {sorted(map(str, source.dtypes(files)))}, model {state[name].dtype})"
        for name, source in match.stacked.items()
        if any(_kind(dtype) != _kind(state[name].dtype) for dtype in source.dtypes(files))
    ]
    if kinds:
        problems["dtypes"] = kinds
    meta = [key for key, tensor in match.targets.items() if tensor.device.type == "meta"]
    meta += [name for name in match.stacked if state[name].device.type == "meta"]
    if meta and not allow_meta:
        problems["meta"] = meta
    return problems


def _kind(dtype: torch.dtype) -> str:
    return "float" if dtype.is_floating_point else "bool" if dtype == torch.bool else "int"


def first(names: Sequence[str]) -> str:
    """The first :data:`SHOWN` names, and how many more there are."""
    more = f" (and {len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more
