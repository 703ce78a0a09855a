"""Checkpoint IO for sharded (DTensor/FSDP2) models: a torch.distributed.checkpoint (DCP) folder per checkpoint.

Layout (the same as Lightning's ModelParallelStrategy, so its consolidation tool reads it)::

    step=3.ckpt/
        __0_0.distcp ...   DCP shards: {"state_dict": model, "optimizer_0": ..., ...}, written by every rank
        .metadata          DCP index
        meta.pt            everything else Lightning saves (loops, callbacks, hyperparameters, epoch, step)
        COMPLETE           written last: a folder without it is an unfinished save and is never loaded

Saves are atomic: the folder is written under a temporary name beside the target and renamed into place, so a
save that dies midway leaves the previous checkpoint at that path untouched.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import CheckpointIO
from typing_extensions import override

METADATA_FILENAME = "meta.pt"
COMPLETE_MARKER = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unfinished or does not match the model."""


class DistributedCheckpointIO(CheckpointIO):
    """Sharded checkpoints through ``torch.distributed.checkpoint``; every rank writes its own shards.

    Both methods are collective: every rank of the job must call them with the same path.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        path = Path(path)
        checkpoint = dict(checkpoint)
        sharded = {"state_dict": checkpoint.pop("state_dict")}
        for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            sharded[f"optimizer_{idx}"] = optim_state
        tmp = path.parent / f".{path.name}.tmp-{_shared_token()}"
        _on_rank_zero_then_check(lambda: tmp.mkdir(parents=True, exist_ok=False), f"create {tmp}")
        dcp.save(sharded, checkpoint_id=tmp)

        def finish() -> None:
            torch.save(checkpoint, tmp / METADATA_FILENAME)
            (tmp / COMPLETE_MARKER).write_text("ok\n")
            _publish(tmp, path)

        _on_rank_zero_then_check(finish, f"publish the checkpoint at {path}")

    @override
    def load_checkpoint(self, path: _PATH, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """Load only the metadata (everything but the sharded model and optimizer states)."""
        path = validate_checkpoint_dir(path)
        return torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=bool(weights_only))

    def load_sharded(self, path: _PATH, state: dict[str, Any]) -> None:
        """Fill ``state`` (``{"state_dict": ..., "optimizer_0": ...}`` of sharded tensors) in place from ``path``."""
        path = validate_checkpoint_dir(path)
        dcp.load(state, checkpoint_id=path)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        path = Path(path)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def validate_checkpoint_dir(path: _PATH) -> Path:
    """Check that ``path`` is a finished sharded checkpoint; raise :class:`CheckpointError` saying what is wrong."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"Checkpoint not found: {str(path)!r} does not exist.")
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a file, but this strategy expects a sharded checkpoint folder (as it saves them)."
        )
    if not (path / COMPLETE_MARKER).is_file() or not (path / METADATA_FILENAME).is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a complete checkpoint (no {COMPLETE_MARKER!r} marker or {METADATA_FILENAME!r}):"
            " the save that wrote it did not finish. Resume from an earlier checkpoint."
        )
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{str(path)!r} has no DCP index file '.metadata'; the folder is corrupt.")
    return path


def _publish(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` folder to ``path``, replacing what was there only once the new one is complete."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def _on_rank_zero_then_check(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0 and raise on *every* rank if it failed, so no rank waits forever for rank 0."""
    error: list[str | None] = [None]
    if _rank() == 0:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 (re-raised on every rank below)
            error[0] = f"{type(err).__name__}: {err}"
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(f"Rank 0 could not {what}: {error[0]}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _shared_token() -> str:
    token = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    return token[0]
