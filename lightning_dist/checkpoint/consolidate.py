"""Reading any lightning_dist checkpoint as one ordinary Lightning checkpoint dict, in one process, and writing it
out as one file (``torch.save`` or safetensors) for export."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

from lightning_dist.checkpoint.export_target import SAFETENSORS_MARKER, check_export_target, mark_export
from lightning_dist.checkpoint.integrity import crc32_enabled, verify_checksums
from lightning_dist.checkpoint.layout import (
    PROVENANCE_KEY,
    CheckpointError,
    is_sharded_checkpoint,
    new_token,
    publish,
    read_checkpoint_file,
    read_metadata,
    temporary_path,
)
from lightning_dist.checkpoint.optimizer_format import is_name_keyed, names_to_positions
from lightning_dist.checkpoint.safe_load import RestrictedBytesLoading, dcp_reader, shard_error
from lightning_dist.checkpoint.save_failures import save_failure
from lightning_dist.checkpoint.state_paths import get_path, saved_state_paths, set_path
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.compat import load_dcp_without_process_group
from lightning_dist.progress import Progress

#: The tool recorded in the export mark of what this module writes.
EXPORT_TOOL = "consolidate"
#: Keys a weights-only export keeps: enough for ``LightningModule.load_from_checkpoint``.
WEIGHTS_ONLY_KEYS = ("state_dict", "hyper_parameters", "hparams_name", "pytorch-lightning_version", "lightning_dist")


def load_full_checkpoint(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """The checkpoint at ``path`` as one dict in the format of a one-device Lightning checkpoint (full tensors,
    position-keyed ``optimizer_states``), whether it is a sharded folder or a single file, after verifying its
    checksums. Needs no process group, and uses none when one exists (``if trainer.is_global_zero:
    MyModule.load_from_checkpoint(folder)`` after a distributed fit): this process verifies every file.
    ``weights_only=False`` trusts the files with full unpickling."""
    path = validate_checkpoint(path, weights_only)
    verify_checksums(path, weights_only, alone=True)
    if not is_sharded_checkpoint(path):
        return read_checkpoint_file(path, weights_only, mmap=False)
    checkpoint = read_metadata(path, weights_only)
    try:
        restricted = RestrictedBytesLoading if weights_only else None
        sharded = load_dcp_without_process_group(dcp_reader(path, weights_only), restricted)
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise shard_error(err, f"Could not read the shards of {str(path)!r}") from err
    if not isinstance(sharded.get("state_dict"), dict):
        raise CheckpointError(f"The checkpoint {str(path)!r} holds no 'state_dict' of model weights in its shards.")
    for state_path in saved_state_paths(checkpoint.get(PROVENANCE_KEY, {})):  # weight averaging's, state_dict's
        set_path(checkpoint, state_path, get_path(sharded, state_path))
    optimizers = sorted((k for k in sharded if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_position_keyed(sharded[k]) for k in optimizers]
    return checkpoint


def weights_only(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Drop optimizer, loop and callback states; what remains loads with ``load_from_checkpoint``."""
    return {k: v for k, v in checkpoint.items() if k in WEIGHTS_ONLY_KEYS}


def save_torch(
    checkpoint: dict[str, Any], out: str | os.PathLike, source: str | os.PathLike | None = None, progress: bool = False
) -> Path:
    """``torch.save`` ``checkpoint`` to ``out`` atomically (temporary file, then rename), marked as an export. ``out``
    must be free or an earlier export (:func:`~lightning_dist.checkpoint.export_target.check_export_target`; ``source``:
    the checkpoint it was read from, which it may not replace); ``progress``: show the bytes written on stderr."""
    out = check_export_target(out, source)
    total = sum(value.nbytes for value in _tensors(checkpoint))
    # a Python file, not a path: torch's own writer hides the operating system's reason for a failed write
    shown = Progress(total, "consolidate", quiet=not progress)
    with _written_atomically(out) as tmp, crc32_enabled(), open(tmp, "wb") as file, shown:
        torch.save(mark_export(checkpoint, EXPORT_TOOL), _CountedWrites(file, shown))
    return out


class _CountedWrites(io.RawIOBase):
    """A file that tells ``progress`` how many bytes each write wrote (``torch.save`` writes through it)."""

    def __init__(self, file: Any, progress: Progress) -> None:
        super().__init__()
        self.file, self.progress = file, progress

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self.file.write(data)
        self.progress.update(min(len(data), max(self.progress.total - self.progress.done, 0)))
        return written

    def flush(self) -> None:
        self.file.flush()


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested checkpoint dict (what its file mostly holds)."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def save_safetensors(
    checkpoint: dict[str, Any], out: str | os.PathLike, source: str | os.PathLike | None = None
) -> Path:
    """Write the model weights (``state_dict``) as a safetensors file; scalars of the checkpoint go to its metadata,
    with the export mark. ``out`` and ``source`` as in :func:`save_torch`."""
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError(
            "safetensors output needs the `safetensors` package: pip install 'lightning-dist[export]'"
        ) from err
    out = check_export_target(out, source)
    tensors = {k: v.detach().contiguous().clone() for k, v in checkpoint["state_dict"].items() if torch.is_tensor(v)}
    metadata = {k: str(checkpoint[k]) for k in ("epoch", "global_step", "pytorch-lightning_version") if k in checkpoint}
    metadata[SAFETENSORS_MARKER] = "consolidated"
    with _written_atomically(out) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return out


@contextmanager
def _written_atomically(out: Path) -> Iterator[Path]:
    """A temporary path to write ``out``'s content to, published as ``out`` when the block ends; a write that fails
    removes the temporary file and raises a :class:`CheckpointError` naming ``out`` and the cause."""
    tmp = temporary_path(out, new_token())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        publish(tmp, out)
    except Exception as err:
        raise save_failure(out, err, tmp) from err


def _position_keyed(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    return names_to_positions(optimizer_state) if is_name_keyed(optimizer_state) else optimizer_state
