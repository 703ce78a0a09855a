"""Reading checkpoint files without running code from them.

A pickle can call any function it names, so an unpickled checkpoint can run a shell command. torch's
``weights_only=True`` (its default for ``torch.load`` since 2.6) allows only tensors and plain data; this module
extends the same rule to everything else the package reads:

* :func:`resolve_weights_only`: ``weights_only=None`` means what it means to ``torch.load`` of a local file (``True``
  unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set), as in Lightning.
* :func:`load_file`: ``torch.load`` honouring that choice; a file that needs more than plain data raises
  :class:`~lightning_dist.CheckpointError` naming the type and how to opt in.
* :class:`RestrictedFileSystemReader`: DCP's ``.metadata`` index, which torch reads with plain ``pickle.load``,
  read by an unpickler that knows only DCP's metadata classes and the torch types they hold.
* :class:`ContainedFileSystemReader` (the base of the restricted reader, and the reader of trusted folders): every
  file the index names is checked to lie inside the folder before any is read
  (:mod:`~lightning_dist.checkpoint.contained_paths`).
* :class:`RestrictedLoadPlanner`: the non-tensor items of DCP shards, which torch's planner unpickles with
  ``weights_only=False``, checked to load with ``weights_only=True`` first.
* :func:`probe_entries`: the top-level plain entries of a ``torch.save`` file, for "is this checkpoint ours?",
  without constructing anything the file names (every class and function becomes an inert placeholder, and no
  tensor data is read).

``weights_only=False`` (Lightning's own flag, or ``--trust-code`` on the command line) restores full unpickling for
files the user trusts.
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
import re
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from lightning_dist.checkpoint.contained_paths import checkpoint_file
from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.compat import dcp_storage_info_class, layout_lookup

#: DCP's index file in a checkpoint folder.
DCP_INDEX = ".metadata"

#: How to opt in, for messages.
TRUST_ADVICE = (
    "If you trust where the file comes from, opt in to full unpickling: `weights_only=False` in"
    " `trainer.fit/validate/test/predict(..., ckpt_path=..., weights_only=False)`, or `--trust-code` for"
    " `lightning-dist inspect` and `consolidate`"
)


def resolve_weights_only(weights_only: bool | None) -> bool:
    """What ``torch.load(weights_only=weights_only)`` does with a local file: ``None`` is torch's default (``True``
    unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``); ``TORCH_FORCE_WEIGHTS_ONLY_LOAD=1`` forces ``True``."""
    if _env_flag("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        return True
    if weights_only is None:
        return not _env_flag("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    return bool(weights_only)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "y", "yes", "true")


def load_file(file: Path, weights_only: bool, **load_options: Any) -> Any:
    """``torch.load`` of ``file`` on the CPU; with ``weights_only``, a file that needs a type beyond plain data raises
    :class:`CheckpointError` naming it (the file's code never runs)."""
    options: dict[str, Any] = {"map_location": "cpu", "mmap": zipfile.is_zipfile(file), **load_options}
    try:
        return torch.load(file, weights_only=weights_only, **options)
    except pickle.UnpicklingError as err:
        refused = _refused_type(str(err)) if weights_only else None
        if refused is None:  # not a refusal: a damaged file, reported as such by the caller
            raise
        raise CheckpointError(
            f"{str(file)!r} needs the type {refused!r} to be unpickled, and loading it would run code named by"
            f" the file. lightning_dist loads checkpoints with weights_only=True (torch's default), which restores"
            f" tensors and plain data only. {TRUST_ADVICE}. A module that saves its own objects in"
            " `on_save_checkpoint` can store them as plain data (dicts, lists, numbers, strings) instead."
        ) from err


def _refused_type(message: str) -> str | None:
    """The global that torch's weights-only unpickler refused, from its message (``None``: it refused something else,
    such as bytes that are no pickle at all)."""
    match = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"Unsupported global: ([\w.]+)", message)
    if match is None:
        return None
    return match.group(1) if "." in match.group(1) else f"builtins.{match.group(1)}"  # torch drops "builtins."


# ------------------------------------------------------------------------------------------------- DCP's index file
def _classes_of(module: Any) -> dict[str, type]:
    return {
        name: obj for name, obj in vars(module).items() if inspect.isclass(obj) and obj.__module__ == module.__name__
    }


def _torch_constants() -> dict[str, Any]:
    """The torch names a DCP index pickles: ``Size``, dtypes, layouts and memory formats."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {"Size": torch.Size, **{name: obj for name, obj in vars(torch).items() if isinstance(obj, kinds)}}


#: Everything a DCP ``.metadata`` file may name: DCP's metadata classes, its file-system storage record, torch's
#: shape and dtype types, and the layout lookup torch pickles layouts with.
_DCP_INDEX_GLOBALS: dict[str, dict[str, Any]] = {
    dcp_metadata.__name__: _classes_of(dcp_metadata),
    dcp_filesystem.__name__: {"_StorageInfo": dcp_storage_info_class()},
    "torch": _torch_constants(),
    "torch.serialization": {"_get_layout": layout_lookup()},
    "collections": {"OrderedDict": OrderedDict},
    "pathlib": {"PosixPath": Path, "WindowsPath": Path, "Path": Path},
}


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a class or function outside the allow-list (the message is its ``module.name``)."""


class _DCPIndexUnpickler(pickle.Unpickler):
    """Unpickles only what :data:`_DCP_INDEX_GLOBALS` lists; anything else is an error naming it."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _DCP_INDEX_GLOBALS.get(module, {})
        if name in allowed:
            return allowed[name]
        raise _RefusedGlobal(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a DCP index holds no persistent references")


def read_dcp_index(folder: Path) -> Metadata:
    """The ``.metadata`` index of a DCP folder, read without running code from it; raises :class:`CheckpointError`
    naming the type if it needs anything beyond DCP's metadata."""
    file = checkpoint_file(folder, DCP_INDEX)
    with open(file, "rb") as stream:
        try:
            metadata = _DCPIndexUnpickler(stream).load()
        except _RefusedGlobal as err:
            raise CheckpointError(
                f"The DCP index {str(file)!r} names {str(err)!r}, which is not one of the metadata types that"
                " torch.distributed.checkpoint writes; unpickling it could run code from the file, so it is refused."
                f" {TRUST_ADVICE}."
            ) from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"The DCP index {str(file)!r} holds a {type(metadata).__name__}, not torch.distributed.checkpoint's"
            " Metadata; the folder is damaged."
        )
    return metadata


class ContainedFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` that reads only files inside its folder: the index itself, and every file the
    index names, checked when DCP sets the reader up with the index (torch's ``read_data`` then joins those names to
    the folder as they are). A refusal there reaches the caller as a failure of ``dcp.load`` (:func:`shard_error`);
    raised from ``read_metadata``, DCP would take it for a missing index and look for per-rank ones."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # a per-rank index (no-collective saves): not something we write
            raise CheckpointError(f"{str(self.path)!r} has per-rank DCP indexes, which lightning_dist does not read.")
        metadata = self._read_index()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        check_index_files(Path(self.path), metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def _read_index(self) -> Metadata:
        """torch's own reading of the index (full unpickling: the user trusts the folder)."""
        with open(checkpoint_file(self.path, DCP_INDEX), "rb") as stream:
            return pickle.load(stream)


def check_index_files(folder: Path, metadata: Metadata) -> list[str]:
    """The files a DCP index names, each checked to lie inside ``folder``
    (:func:`~lightning_dist.checkpoint.contained_paths.checkpoint_file`)."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"The DCP index of {str(folder)!r} holds no table of files; the folder is damaged.")
    names: dict[Any, None] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not (isinstance(name, str) and name in names):  # thousands of items name a few files
            checkpoint_file(folder, name, "its DCP index")
            names[name] = None
    return list(names)


class RestrictedFileSystemReader(ContainedFileSystemReader):
    """:class:`ContainedFileSystemReader` whose index is read by :func:`read_dcp_index` (torch's uses
    ``pickle.load``)."""

    def _read_index(self) -> Metadata:
        return read_dcp_index(Path(self.path))


def dcp_reader(folder: str | os.PathLike, weights_only: bool = True) -> FileSystemReader:
    """The storage reader of a DCP folder: restricted with ``weights_only``, torch's unpickling otherwise; both read
    only files inside ``folder``."""
    return RestrictedFileSystemReader(folder) if weights_only else ContainedFileSystemReader(folder)


class RestrictedBytesLoading:
    """A DCP load planner mixin: the non-tensor items of the shards (optimizer hyperparameters, extra state), which
    torch's ``DefaultLoadPlanner.load_bytes`` unpickles with ``weights_only=False``, must first load with
    ``weights_only=True``. Bytes that pass hold only tensors and plain data, so torch's full unpickling of the same
    bytes, which then restores them, calls nothing else."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as err:
            refused = _refused_type(str(err))
            raise CheckpointError(
                f"The shard item {read_item.dest_index.fqn!r} needs "
                + (f"the type {refused!r}" if refused else "more than plain data")
                + f" to be unpickled, which could run code from the checkpoint, so it is refused. {TRUST_ADVICE}."
            ) from err
        super().load_bytes(read_item, io.BytesIO(data))  # type: ignore[misc]


class RestrictedLoadPlanner(RestrictedBytesLoading, DefaultLoadPlanner):
    """DCP's default load planner with :class:`RestrictedBytesLoading`."""


def shard_error(err: BaseException, context: str) -> CheckpointError:
    """The error to raise for a failed DCP load: a refusal of ours (which DCP wraps in its ``CheckpointException``,
    per rank) with its own message, anything else as ``context: err``."""
    if isinstance(err, CheckpointError):
        return err
    for failure in getattr(err, "failures", {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, CheckpointError):
            return CheckpointError(str(cause))
    return CheckpointError(f"{context}: {err}")


def dcp_load_planner(weights_only: bool = True, **options: Any) -> DefaultLoadPlanner:
    """The load planner of a DCP folder: restricted with ``weights_only``, torch's own otherwise."""
    return RestrictedLoadPlanner(**options) if weights_only else DefaultLoadPlanner(**options)


# ------------------------------------------------------------------------------------------------------- probing
class _Inert:
    """What a probed pickle gets for every class or function it names: accepts anything, does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _ProbeUnpickler(pickle.Unpickler):
    """Builds dicts, lists, strings and numbers; every named global is :class:`_Inert`, every tensor ``None``."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        return _Inert

    def persistent_load(self, pid: Any) -> None:
        return None


def probe_entries(file: Path) -> dict[str, Any] | None:
    """The plain top-level entries of a ``torch.save`` file (zip format), or ``None`` if it is not one holding a dict.
    Runs nothing from the file and reads no tensor data."""
    try:
        with zipfile.ZipFile(file) as archive:
            records = [name for name in archive.namelist() if name.endswith("/data.pkl") and name.count("/") == 1]
            if len(records) != 1:
                return None
            content = _ProbeUnpickler(io.BytesIO(archive.read(records[0]))).load()
    except Exception:  # noqa: BLE001 (anything unreadable is simply not a checkpoint we recognise)
        return None
    return content if isinstance(content, dict) else None
