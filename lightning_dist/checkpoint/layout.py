"""What a lightning_dist checkpoint looks like on disk, and how it gets there without ever looking complete early.

Two formats:

* sharded (``DistributedCheckpointIO``, ``AsyncDistributedCheckpointIO``): a folder, the same layout as Lightning's
  ModelParallelStrategy, so its consolidation tool reads it too::

      step=3.ckpt/
          __0_0.distcp ...   DCP shards {"state_dict": model, "optimizer_0": ...}, written by every rank (with
                             weight averaging also "current_model_state" or a callback's averaged model state)
          .metadata          DCP index
          meta.pt            everything else Lightning saves (loops, callbacks, hyperparameters, epoch, step)
          COMPLETE           written last: a folder without it is an unfinished save and is never loaded; it holds
                             the size and CRC-32 of every other file (:mod:`lightning_dist.checkpoint.integrity`)

* full state (``FullStateCheckpointIO``): one ``torch.save`` file, a plain Lightning checkpoint (its zip directory
  holds a CRC-32 of every record).

Every file a folder names (its DCP index's paths, its ``COMPLETE`` manifest's entries, its files of fixed name) must
lie inside it: :mod:`lightning_dist.checkpoint.contained_paths`.

Both are written under a hidden temporary name beside the target (``.step=3.ckpt.tmp-<token>``) and renamed into
place, so a save that dies midway leaves the previous checkpoint at that path untouched. One killed after its write
finished but before its renames did leaves a complete checkpoint under a hidden name: the next start, or the next
save of that name, publishes it (:mod:`~lightning_dist.checkpoint.recovery`). A save that fails (a full disk) removes
its temporary file or folder and says why (:mod:`~lightning_dist.checkpoint.save_failures`).

A save replaces only what is provably one of our own complete checkpoints (:func:`check_replaceable`): a folder
with the ``COMPLETE`` marker whose ``meta.pt`` carries our ``lightning_dist`` entry, or a single file whose
checkpoint dict carries it. Anything else at the target (a user's folder or file, a checkpoint of another tool, a
link) makes the save fail before anything is written.

Lightning's own ``ModelParallelStrategy`` (and ``FSDPStrategy`` with sharded state) writes the same folder layout
without the ``COMPLETE`` marker: the DCP shards and their ``.metadata`` index first, ``meta.pt`` last. It writes in
place, so such a folder is complete when both ``.metadata`` and ``meta.pt`` are there. Ours are never unfinished at
their final name (they are renamed into place) and their ``meta.pt`` carries our entry, so a folder with both files,
no marker and a ``meta.pt`` without our entry is taken to be Lightning's.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from lightning_dist.checkpoint.contained_paths import checkpoint_file
from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.safe_load import DCP_INDEX, load_file, probe_entries
from lightning_dist.checkpoint.state_paths import without_model_states

METADATA_FILENAME = "meta.pt"
COMPLETE_MARKER = "COMPLETE"
#: The entry of every checkpoint we write (strategy, world size, mesh, data position...): how a save recognises a
#: checkpoint of ours it may replace.
PROVENANCE_KEY = "lightning_dist"
TMP_INFIX = ".tmp-"
OLD_INFIX = ".old-"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a sharded (DCP folder) checkpoint rather than a single file."""
    return Path(path).is_dir()


def is_lightning_sharded_checkpoint(path: Path) -> bool:
    """A complete sharded checkpoint written by Lightning's ``ModelParallelStrategy`` or ``FSDPStrategy`` (no
    ``COMPLETE`` marker; ``meta.pt``, without our provenance entry, is written after the DCP index)."""
    return (
        path.is_dir()
        and not (path / COMPLETE_MARKER).exists()
        and (path / DCP_INDEX).is_file()
        and (path / METADATA_FILENAME).is_file()
        and not _is_ours(path / METADATA_FILENAME)
    )


def check_replaceable(path: str | os.PathLike) -> None:
    """Raise :class:`CheckpointError`, before anything is written, unless ``path`` is free or holds one of our own
    complete checkpoints (a re-save of the same name, such as ``last.ckpt``)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return
    problem = foreign_content(path)
    if problem is not None:
        raise CheckpointError(
            f"Refusing to write a checkpoint to {str(path)!r}: {problem}. A save replaces only a complete"
            " lightning_dist checkpoint of the same name. Choose another path, or move what is there away yourself."
        )


def foreign_content(path: Path) -> str | None:
    """``None`` if ``path`` holds one of our own complete checkpoints, else what is there (for messages)."""
    if path.is_symlink():
        return f"it is a symbolic link (to {os.readlink(path)!r})"
    if path.is_dir():
        if is_lightning_sharded_checkpoint(path):
            return "it is a sharded checkpoint written by another tool (Lightning's ModelParallelStrategy?)"
        if (path / COMPLETE_MARKER).is_file() and _is_ours(path / METADATA_FILENAME):
            return None
        entries = sorted(p.name for p in path.iterdir())
        if not entries:
            return "it is an empty directory"
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
        return f"it is a directory that is not a lightning_dist checkpoint ({count}: {shown})"
    if path.is_file():
        return None if _is_ours(path) else f"it is a file that is not a lightning_dist checkpoint ({file_size(path)})"
    return "it is neither a file nor a directory"


def _is_ours(file: Path) -> bool:
    """Whether ``file`` is a ``torch.save`` dict carrying our provenance entry. Nothing in the file is run and no
    tensor is read (:func:`~lightning_dist.checkpoint.safe_load.probe_entries`)."""
    entries = probe_entries(file)
    return entries is not None and isinstance(entries.get(PROVENANCE_KEY), dict)


def file_size(path: Path) -> str:
    """A file's size for messages (bytes, KiB or MiB)."""
    size = path.stat().st_size
    return f"{size} bytes" if size < 1024 else f"{size / 1024:.1f} KiB" if size < 2**20 else f"{size / 2**20:.1f} MiB"


def with_provenance(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with our provenance entry (the strategy fills it in; an IO plugin used directly adds an empty
    one), so a later save recognises the result as ours."""
    if not isinstance(checkpoint.get(PROVENANCE_KEY), dict):
        checkpoint = {**checkpoint, PROVENANCE_KEY: {}}
    return checkpoint


def read_metadata(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """Everything in a (validated) checkpoint except the model and optimizer states: Lightning's loop, callback
    and hyperparameter entries plus lightning_dist's own. Loads no tensors of a sharded checkpoint. With
    ``weights_only`` (the default) nothing but plain data and tensors is unpickled."""
    path = Path(path)
    if path.is_dir():
        meta = load_torch_file(checkpoint_file(path, METADATA_FILENAME), path, weights_only)
        if not isinstance(meta, dict):
            raise CheckpointError(
                f"The checkpoint {str(path)!r} is damaged: {str(path / METADATA_FILENAME)!r} holds a"
                f" {type(meta).__name__}, not the dict of Lightning's checkpoint entries."
            )
        return meta
    return without_model_states(read_checkpoint_file(path, weights_only))


def load_torch_file(file: Path, checkpoint: Path, weights_only: bool = True, **load_options: Any) -> Any:
    """``torch.load`` of one file of ``checkpoint`` on the CPU (:func:`~lightning_dist.checkpoint.safe_load.load_file`),
    with a :class:`CheckpointError` naming the file if it cannot be read."""
    try:
        return load_file(file, weights_only, **load_options)
    except CheckpointError:
        raise
    except Exception as err:
        text = str(err).split("WeightsUnpickler error:")[-1].strip()  # torch's advice about weights_only precedes it
        reason = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
        if file == checkpoint:
            message = f"The checkpoint file {str(file)!r} cannot be read as a PyTorch checkpoint ({reason})."
        else:
            message = f"The checkpoint {str(checkpoint)!r} is damaged: {str(file)!r} cannot be read ({reason})."
        raise CheckpointError(message) from err


def read_checkpoint_file(path: Path, weights_only: bool = True, **load_options: Any) -> dict[str, Any]:
    """A single-file checkpoint, checked to be a Lightning checkpoint dict (a ``state_dict`` of model weights)."""
    return require_lightning_checkpoint(load_torch_file(path, path, weights_only, **load_options), path)


def require_lightning_checkpoint(checkpoint: Any, path: Path) -> dict[str, Any]:
    """``checkpoint`` if it is a Lightning checkpoint dict (a ``state_dict`` dict), else a clear error."""
    state = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict):
        what = type(checkpoint).__name__
        if isinstance(checkpoint, dict):
            what += f" with the keys {sorted(map(str, checkpoint))[:8]}"
        raise CheckpointError(
            f"The checkpoint file {str(path)!r} is not a Lightning checkpoint: it holds a {what}, but no 'state_dict'"
            " of model weights. Was it saved with torch.save instead of Trainer.save_checkpoint?"
        )
    return checkpoint


def temporary_path(path: Path, token: str) -> Path:
    """The hidden name a checkpoint is written under before it is published at ``path``."""
    return path.parent / f".{path.name}{TMP_INFIX}{token}"


def aside_path(path: Path, token: str) -> Path:
    """The hidden name the previous checkpoint at ``path`` is moved to while a new one is published there."""
    return path.parent / f".{path.name}{OLD_INFIX}{token}"


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def publish(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` (file or folder) to ``path``, replacing what was there.

    A file over a file is one atomic ``os.replace``. Otherwise the previous checkpoint is first renamed aside
    (``.name.old-*``) and deleted only after the new one is in place. If the second rename fails, the previous
    checkpoint is put back; if the process dies between the two renames, the next start or save finds the new
    checkpoint under its temporary name and publishes it (:mod:`lightning_dist.checkpoint.recovery`).
    """
    if path.exists() and (path.is_dir() or tmp.is_dir()):
        old = aside_path(path, uuid.uuid4().hex[:8])
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except OSError:
            os.replace(old, path)
            raise
        discard(old)
    else:
        os.replace(tmp, path)
    _fsync_dir(path.parent)


def discard(path: Path) -> bool:
    """:func:`remove`, as far as it goes: an error leaves the rest for the next save of the same name to delete.
    Returns whether ``path`` is gone."""
    try:
        remove(path)
    except OSError:
        pass
    return not path.exists() and not path.is_symlink()


def remove(path: Path) -> None:
    """Delete a checkpoint file or folder. A folder first loses its completion marker, so a deletion that fails
    halfway never leaves something that loads as a checkpoint. Callers make sure ``path`` is ours
    (:func:`remove_own_checkpoint`) or one of our temporaries."""
    if path.is_dir() and not path.is_symlink():
        (path / COMPLETE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_own_checkpoint(path: Path) -> bool:
    """Delete ``path`` if it is one of our own complete checkpoints; leave anything else alone. Returns whether it
    was deleted (a missing path counts as deleted)."""
    if not path.exists() and not path.is_symlink():
        return True
    if foreign_content(path) is not None:
        return False
    remove(path)
    return True


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
