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
    """Every tensor in one safetensors file, checked as the ``safetensors`` library reads it (the header, each
    tensor's offsets inside the file and without overlap, its byte size against its shape and dtype): a damaged file
    is refused here, before launch, naming the file and, where one is to blame, the tensor."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        what = "a folder" if file.is_dir() else "not there"
        raise CheckpointError(f"Pretrained weights: {str(file)!r} is {what}, not a safetensors file.")
    try:
        with safe_open(str(file), framework="pt") as handle:
            entries = {key: handle.get_slice(key) for key in handle.keys()}
            described = {key: (tuple(piece.get_shape()), piece.get_dtype()) for key, piece in entries.items()}
    except (SafetensorError, OSError) as err:
        why = _header_problem(file) or str(err).removeprefix("Error while deserializing header: ")
        raise CheckpointError(
            f"Pretrained weights: {str(file)!r} is not a readable safetensors file: {why}. Download or copy it again"
            " (a transfer that stopped early leaves such a file)."
        ) from None
    tensors = {}
    for key, (shape, dtype_name) in described.items():
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(f"Pretrained weights: {str(file)!r} holds {key!r} of an unknown dtype {dtype_name!r}.")
        tensors[key] = FileTensor(shape, dtype, file)
    return tensors


def _header_problem(file: Path) -> str | None:
    """What in ``file``'s header the safetensors library refused, naming the tensor; ``None`` if not found here."""
    size = file.stat().st_size
    with open(file, "rb") as stream:
        length_bytes = stream.read(8)
        if len(length_bytes) < 8:
            return f"it has {size} bytes, fewer than the 8 of a header's length"
        length = struct.unpack("<Q", length_bytes)[0]
        if not 0 < length <= min(_HEADER_LIMIT, size - 8):
            return f"its header length ({length:,} bytes) does not fit in the file ({size:,} bytes)"
        try:
            header = json.loads(stream.read(length))
        except ValueError:
            return "its header is not JSON"
    if not isinstance(header, dict):
        return f"its header is a JSON {type(header).__name__}, not an object of tensors"
    data_bytes, end = size - 8 - length, 0
    spans = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        missing = [f for f in ("dtype", "shape", "data_offsets") if not isinstance(entry, dict) or f not in entry]
        if missing:
            return f"its entry for tensor {key!r} has no {' and no '.join(missing)}"
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            return f"tensor {key!r} has the unknown dtype {entry['dtype']!r}"
        begin, stop = entry["data_offsets"]
        nbytes = dtype.itemsize * int(torch.Size(entry["shape"]).numel())
        if stop - begin != nbytes:
            return (
                f"tensor {key!r} ({entry['dtype']} {list(entry['shape'])}) needs {nbytes:,} bytes, but its offsets"
                f" {begin:,}–{stop:,} hold {stop - begin:,}"
            )
        if stop > data_bytes:
            return f"tensor {key!r} ends at byte {stop:,} of the data, which has {data_bytes:,} (the file is cut short)"
        spans.append((begin, stop, key))
    previous = None
    for begin, stop, key in sorted(spans):
        if begin != end:
            where = f"where {previous!r} ends" if previous is not None else "where the data starts"
            how = "overlapping it" if begin < end else "leaving a gap"
            return f"tensor {key!r} starts at byte {begin:,} of the data, {where} at {end:,} ({how})"
        end, previous = stop, key
    if end != data_bytes:
        return f"its tensors end at byte {end:,} of the data, which has {data_bytes:,}"
    return None
