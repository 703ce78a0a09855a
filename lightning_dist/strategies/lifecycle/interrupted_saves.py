"""Before launch: finish the publishing a killed save left half done in the checkpoint folders, so that Lightning's
``ckpt_path="last"`` (which lists the ``ModelCheckpoint`` folder before the strategy sees anything) finds the newest
complete checkpoint, and a new run's saves never replace a complete checkpoint that was left under a hidden name.

Rank 0 does the work (the launching process, before the other ranks exist; under torchrun every rank runs this, and
the others wait until rank 0 has finished, so that every rank lists the same folder). When ``ckpt_path="last"``
finds no complete ``last`` checkpoint where a previous run left traces, the run says so before it trains from step 0.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.recovery import finish_publish, interrupted_publishes, leftovers
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.compat.lightning import last_checkpoints, model_checkpoint_dir

if TYPE_CHECKING:
    import lightning.pytorch as pl

#: How long a rank other than 0 waits for rank 0 to finish publishing (torchrun, SLURM).
WAIT_SECONDS = 120.0


def recover_checkpoint_folders(trainer: pl.Trainer, global_rank: int, ckpt_path: Any) -> None:
    """Finish every interrupted publish in the folders of the Trainer's checkpoint callbacks (rank 0), or wait
    until rank 0 has (other ranks); then, for ``ckpt_path="last"``, warn if no complete ``last`` checkpoint is there."""
    resuming_last = str(ckpt_path) == "last"
    folders = checkpoint_folders(trainer, resolve_logger_folders=resuming_last)
    for folder in folders:
        if global_rank == 0:
            for item in interrupted_publishes(folder):
                finish_publish(item)
                say = rank_zero_warn if item.newest is not None else rank_zero_info  # a newer checkpoint appeared
                say(f"lightning_dist: in {str(folder)!r}, {item.describe()}.")
        else:
            _wait_for_rank_zero(folder)
    if resuming_last and global_rank == 0:
        _warn_without_complete_last(trainer)


def checkpoint_folders(trainer: pl.Trainer, resolve_logger_folders: bool) -> list[Path]:
    """The local folders the Trainer's checkpoint callbacks save into. A ``ModelCheckpoint`` without ``dirpath``
    takes its folder from the logger; it is resolved only when Lightning resolves it too (``ckpt_path="last"``), so
    that nothing about the logger's version is decided here otherwise."""
    folders: list[Path] = []
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is None and resolve_logger_folders and isinstance(callback, ModelCheckpoint):
            dirpath = model_checkpoint_dir(callback, trainer)
        if dirpath is not None and "://" not in str(dirpath) and Path(dirpath).is_dir():
            folders.append(Path(dirpath))
    return list(dict.fromkeys(folders))


def _wait_for_rank_zero(folder: Path) -> None:
    """Wait until rank 0 has published what Lightning will list (deleting what was set aside changes nothing)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while any(item.newest is not None for item in interrupted_publishes(folder)):
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"Rank 0 did not finish publishing the checkpoints an interrupted save left in {str(folder)!r} within"
                f" {WAIT_SECONDS:.0f} s. Check that every rank sees the same folder (a shared file system)."
            )
        time.sleep(0.2)


def _warn_without_complete_last(trainer: pl.Trainer) -> None:
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if any(Path(p).exists() for p in last_checkpoints(callback, trainer)):
            return
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        folder = Path(model_checkpoint_dir(callback, trainer))
        unfinished = sorted(
            entry.name
            for name, entries in leftovers(folder).items()
            if name.startswith(callback.CHECKPOINT_NAME_LAST)
            for entry in entries
        )
        newest = _newest_complete_checkpoint(folder)
        if not unfinished and newest is None:
            continue  # a first run: Lightning's own warning says there is no last checkpoint yet
        why = ""
        if unfinished:
            why = (
                f" (a save of it was stopped before its write finished: {', '.join(map(repr, unfinished))} is"
                " incomplete and is deleted by the next save)"
            )
        hint = ""
        if newest is not None:
            hint = f" The newest complete checkpoint there is {newest.name!r}: pass ckpt_path={str(newest)!r} to resume"
            hint += " from it instead."
        rank_zero_warn(
            f'ckpt_path="last": there is no complete `last` checkpoint in {str(folder)!r}{why}, so training starts'
            f" from scratch.{hint}"
        )


def _newest_complete_checkpoint(folder: Path) -> Path | None:
    """The most recently saved checkpoint in ``folder`` that passes the cheap checks, if any."""
    try:
        entries = [e for e in folder.iterdir() if not e.name.startswith(".") and e.suffix == ".ckpt"]
    except OSError:
        return None
    for entry in sorted(entries, key=lambda e: e.stat().st_mtime, reverse=True):
        try:
            return validate_checkpoint(entry)
        except CheckpointError:
            continue
    return None
