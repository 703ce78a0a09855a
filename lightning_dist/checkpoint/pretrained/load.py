"""Loading pretrained safetensors weights into a model, sharded or not, through torch DCP's
``HuggingFaceStorageReader``: each rank reads only the slices its DTensor shards hold, and each value is converted to
the dtype of the tensor it lands in (a bf16 file into fp32 parameters).

The names are matched and every problem refused before any tensor is read (:mod:`.matching`). With a process group,
every rank of it must call :func:`load_pretrained` (DCP agrees on a plan collectively).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, load
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_dist.checkpoint.pretrained.files import read_pretrained_files
from lightning_dist.checkpoint.pretrained.matching import match_keys


@dataclass(frozen=True)
class PretrainedLoad:
    """What :func:`load_pretrained` did: the prefix of the pretrained submodule, how many tensors it loaded, the tied
    names loaded through another name, and the model's state outside the prefix that it left as it was."""

    path: Path
    prefix: str
    loaded: int
    tied: dict[str, tuple[str, ...]]
    outside_prefix: tuple[str, ...]


def load_pretrained(model: nn.Module, path: str | os.PathLike, prefix: str | None = None) -> PretrainedLoad:
    """Load the safetensors weights at ``path`` (a Hugging Face folder or one ``*.safetensors`` file) into ``model``'s
    parameters and persistent buffers in place, DTensor shards included. ``prefix``: the name of the submodule that
    holds the pretrained model, with its dot (``"model."``); found from the names when ``None``.

    Raises :class:`~lightning_dist.checkpoint.CheckpointError` before reading any tensor when the files do not fit the
    model; the model must be materialized (no meta tensors)."""
    files = read_pretrained_files(path)
    match = match_keys(model, files, prefix)
    reader = _ListedFilesReader(files.path if files.path.is_dir() else files.path.parent, files.files)
    single_process = not (dist.is_available() and dist.is_initialized())
    load(dict(match.targets), storage_reader=reader, no_dist=single_process)
    return PretrainedLoad(files.path, match.prefix, len(match.targets), match.tied, match.outside_prefix)


class _ListedFiles(FileSystem):
    """A file system whose folder listing is the given files: DCP's reader reads every ``*.safetensors`` it lists."""

    def __init__(self, files: tuple[Path, ...]) -> None:
        super().__init__()
        self.files = [str(file.absolute()) for file in files]

    def ls(self, path: str | os.PathLike) -> list[str]:
        return list(self.files)


class _ListedFilesReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` reading only the files of the index (or the one file given), not every
    ``*.safetensors`` file beside them."""

    def __init__(self, folder: Path, files: tuple[Path, ...]) -> None:
        super().__init__(str(folder))
        self.fs = _ListedFiles(files)
