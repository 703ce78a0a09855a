"""How an export splits a model's tensors into safetensors shards of at most a given size, and their index, in the
layout Hugging Face's ``save_pretrained`` writes (``model-00001-of-00003.safetensors`` and
``model.safetensors.index.json``, or one ``model.safetensors``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lightning_dist.checkpoint.errors import CheckpointError

#: The one file of a model that fits one shard.
SINGLE_FILE = "model.safetensors"
#: The index of a sharded model: total size and which file holds each tensor.
INDEX_FILE = "model.safetensors.index.json"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` (10**9, as Hugging Face counts), ``"500MB"`` or ``"2GiB"``."""
    if isinstance(size, bool):
        raise CheckpointError(f"A shard size must be a number of bytes or a string like '5GB', not {size!r}.")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise CheckpointError(
                f"Cannot read the shard size {size!r}: give a number of bytes or a number with a unit"
                f" ({', '.join(u for u in _UNITS if u)}), such as '5GB' or '500MB'."
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise CheckpointError(f"A shard size must be positive, not {size!r}.")
    return value


@dataclass
class Shard:
    """The tensors of one output file: ``(name in the file, name in the checkpoint)`` pairs and their bytes."""

    entries: list[tuple[str, str]] = field(default_factory=list)
    nbytes: int = 0


def plan_shards(tensors: list[tuple[str, str, int]], max_bytes: int) -> list[Shard]:
    """Consecutive groups of ``(output name, checkpoint name, bytes)`` of at most ``max_bytes`` each; a tensor larger
    than ``max_bytes`` gets a shard of its own (as ``save_pretrained`` does)."""
    shards: list[Shard] = []
    for out_name, source_name, nbytes in tensors:
        if not shards or (shards[-1].entries and shards[-1].nbytes + nbytes > max_bytes):
            shards.append(Shard())
        shards[-1].entries.append((out_name, source_name))
        shards[-1].nbytes += nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    """The file names of ``count`` shards."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def shard_index(shards: list[Shard], names: list[str]) -> dict:
    """The content of ``model.safetensors.index.json``."""
    weight_map = {out: name for shard, name in zip(shards, names) for out, _ in shard.entries}
    return {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}
