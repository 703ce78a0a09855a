"""Pretrained weights as they lie on disk: a Hugging Face folder (``model.safetensors.index.json`` and its shards, or
one ``model.safetensors``), a single ``*.safetensors`` file, or a ``torch.save`` state dict (a litgpt folder's
``lit_model.pth``, or a ``*.pth``/``*.pt``/``*.bin`` file). Each safetensors key's shape and dtype come from the
files' headers; a ``torch.save`` file is memory-mapped with weights-only unpickling (nothing but tensors and plain
data is unpickled), so its tensors are read only where a rank copies its slices.

A folder's index is the truth about which files hold the weights: a shard it names that is not there is refused
before anything loads, and other ``*.safetensors`` files beside it (Mistral's ``consolidated.safetensors``) are not
read. Files may be symbolic links (the Hugging Face cache links a snapshot's files to its blobs), but the index may
only name files by relative paths inside the folder.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path, PurePath

import torch

from lightning_dist.checkpoint.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
SUFFIX = ".safetensors"
LIT_MODEL_NAME = "lit_model.pth"
TORCH_SUFFIXES = (".pth", ".pt", ".bin")
_HEADER_LIMIT = 100_000_000  # bytes; safetensors refuses larger headers too
# the safetensors format's dtype names (https://huggingface.co/docs/safetensors/index#format)
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class FileTensor:
    """One tensor of the files: its shape and dtype, and the file that holds it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path


@dataclass(frozen=True)
class PretrainedFiles:
    """The safetensors files of a pretrained model and every tensor they hold, by key."""

    path: Path
    files: tuple[Path, ...]
    tensors: dict[str, FileTensor]
    #: A ``torch.save`` file's tensors, memory-mapped (``None`` for safetensors, which DCP reads).
    mapped: dict[str, torch.Tensor] | None = None


def read_pretrained_files(path: str | os.PathLike) -> PretrainedFiles:
    """The files at ``path`` (a folder or one ``*.safetensors`` file) and their tensors' shapes and dtypes, read from
    the headers. A :class:`CheckpointError` for a path that holds no weights, a missing shard, or an index that names
    keys its shards lack."""
    path = Path(path)
    if path.is_file() and path.suffix in TORCH_SUFFIXES:
        return _torch_file(path)
    if path.is_dir() and not (path / INDEX_NAME).is_file() and (path / LIT_MODEL_NAME).is_file():
        return _torch_file(path / LIT_MODEL_NAME)
    if path.is_file():
        if path.suffix != SUFFIX:
            raise CheckpointError(f"Pretrained weights {str(path)!r}: not a {SUFFIX} file.")
        return PretrainedFiles(path, (path,), _tensors_of(path))
    if not path.is_dir():
        raise CheckpointError(f"Pretrained weights {str(path)!r}: no such file or folder.")
    if (path / INDEX_NAME).is_file():
        return _indexed_folder(path)
    candidates = sorted(path.glob(f"*{SUFFIX}"))
    single = path / SINGLE_FILE_NAME
    if single.is_file() or len(candidates) == 1:
        file = single if single.is_file() else candidates[0]
        return PretrainedFiles(path, (file,), _tensors_of(file))
    found = ", ".join(p.name for p in candidates[:5]) or "no *.safetensors file"
    raise CheckpointError(
        f"Pretrained weights {str(path)!r}: a folder needs {INDEX_NAME} (with its shards) or one {SUFFIX} file; it"
        f" holds {found}."
    )


def _torch_file(file: Path) -> PretrainedFiles:
    """A ``torch.save`` state dict (litgpt's ``lit_model.pth``; a ``{"model": state}`` checkpoint too),
    memory-mapped, unpickled weights-only."""
    try:
        state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling or format error: the file is not what it claims
        raise CheckpointError(
            f"Pretrained weights {str(file)!r}: not a state dict that loads with weights-only unpickling ({err})."
        ) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)} if isinstance(state, dict) else {}
    if not tensors:
        raise CheckpointError(f"Pretrained weights {str(file)!r}: holds no state dict of tensors.")
    described = {key: FileTensor(tuple(value.shape), value.dtype, file) for key, value in tensors.items()}
    return PretrainedFiles(file, (file,), described, tensors)


def _indexed_folder(folder: Path) -> PretrainedFiles:
    index_path = folder / INDEX_NAME
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"Pretrained weights {str(folder)!r}: {INDEX_NAME} has no weight_map ({err!r})."
        ) from None
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        by_file.setdefault(_relative_name(folder, name), []).append(key)
    missing = [name for name in by_file if not (folder / name).is_file()]
    if missing:
        shown = ", ".join(f"{name} ({len(by_file[name])} tensors, e.g. {by_file[name][0]})" for name in missing[:5])
        raise CheckpointError(
            f"Pretrained weights {str(folder)!r}: {len(missing)} of the {len(by_file)} shards its {INDEX_NAME} names"
            f" are not there: {shown}. Was the download interrupted?"
        )
    tensors: dict[str, FileTensor] = {}
    for name, keys in by_file.items():
        held = _tensors_of(folder / name)
        absent = [key for key in keys if key not in held]
        if absent:
            raise CheckpointError(
                f"Pretrained weights {str(folder)!r}: {INDEX_NAME} puts {len(absent)} keys in {name}, which does not"
                f" hold them: {', '.join(absent[:5])}."
            )
        tensors.update({key: held[key] for key in keys})
    return PretrainedFiles(folder, tuple(folder / name for name in by_file), tensors)


def _relative_name(folder: Path, name: object) -> str:
    if not isinstance(name, str) or not name.endswith(SUFFIX):
        raise CheckpointError(f"Pretrained weights {str(folder)!r}: {INDEX_NAME} names {name!r}, not a {SUFFIX} file.")
    pure = PurePath(name)
    if pure.is_absolute() or pure.drive or ".." in pure.parts:
        raise CheckpointError(
            f"Pretrained weights {str(folder)!r}: {INDEX_NAME} names {name!r}, outside the folder; refused."
        )
    return name


def _tensors_of(file: Path) -> dict[str, FileTensor]:
    """Every tensor in one safetensors file, from its header alone (8 bytes of length, then JSON)."""
    with open(file, "rb") as stream:
        size_bytes = stream.read(8)
        size = struct.unpack("<Q", size_bytes)[0] if len(size_bytes) == 8 else -1
        if not 0 < size <= _HEADER_LIMIT:
            raise CheckpointError(f"Pretrained weights: {str(file)!r} is not a safetensors file (no header).")
        try:
            header = json.loads(stream.read(size))
        except ValueError:
            raise CheckpointError(f"Pretrained weights: {str(file)!r} has a damaged safetensors header.") from None
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if dtype is None:
            raise CheckpointError(f"Pretrained weights: {str(file)!r} holds {key!r} of an unknown dtype ({entry!r}).")
        tensors[key] = FileTensor(tuple(entry["shape"]), dtype, file)
    return tensors
