"""Whether a path is a finished, undamaged checkpoint, before anything loads it (:func:`validate_checkpoint`): the
files a folder must hold (:mod:`.layout`), the cheap structure checks (:mod:`.integrity`), and a publish that was
interrupted between its two renames finished first (:mod:`.recovery`)."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_dist.checkpoint.contained_paths import checkpoint_file
from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.integrity import check_structure
from lightning_dist.checkpoint.layout import COMPLETE_MARKER, METADATA_FILENAME, is_lightning_sharded_checkpoint
from lightning_dist.checkpoint.recovery import restore_missing
from lightning_dist.checkpoint.safe_load import DCP_INDEX


def validate_checkpoint(path: str | os.PathLike, weights_only: bool = True) -> Path:
    """Check that ``path`` is a finished, undamaged checkpoint (folder or file) as far as can be told cheaply (files
    present with their recorded sizes, small files matching their checksums); raise :class:`CheckpointError` saying
    what is wrong otherwise. A checkpoint whose publishing was interrupted between its two renames is recovered.
    ``weights_only``: the DCP index is read without running code from it."""
    path = Path(path)
    if not path.exists():
        recovered = _recover_interrupted_publish(path)
        if recovered is None:
            raise CheckpointError(f"Checkpoint not found: {str(path)!r} does not exist.")
    if path.is_dir():
        for name in (COMPLETE_MARKER, METADATA_FILENAME, DCP_INDEX):  # before any of them is looked into
            checkpoint_file(path, name)
        if is_lightning_sharded_checkpoint(path):
            check_structure(path, weights_only)
            return path
        if not (path / COMPLETE_MARKER).is_file() or not (path / METADATA_FILENAME).is_file():
            raise CheckpointError(
                f"{str(path)!r} is not a complete checkpoint (no {COMPLETE_MARKER!r} marker or {METADATA_FILENAME!r}):"
                " the save that wrote it did not finish. Resume from an earlier checkpoint."
            )
        if not (path / DCP_INDEX).is_file():
            raise CheckpointError(f"{str(path)!r} has no DCP index file {DCP_INDEX!r}; the folder is corrupt.")
    elif path.stat().st_size == 0:
        raise CheckpointError(f"{str(path)!r} is an empty file; the checkpoint is corrupt.")
    check_structure(path, weights_only)
    return path


def _recover_interrupted_publish(path: Path) -> Path | None:
    return path if restore_missing(path) else None
