"""The names and sizes of an export's safetensors shards, in the layout Hugging Face's ``save_pretrained`` writes
(``model-00001-of-00003.safetensors`` and ``model.safetensors.index.json``, or one ``model.safetensors``); the split
itself is ``huggingface_hub``'s (``split_torch_state_dict_into_shards``)."""

from __future__ import annotations

import re

from lightning_dist.checkpoint.errors import CheckpointError

#: ``huggingface_hub``'s pattern for the files of a model: ``model.safetensors``, ``model-00001-of-00003.safetensors``.
SHARD_PATTERN = "model{suffix}.safetensors"
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
