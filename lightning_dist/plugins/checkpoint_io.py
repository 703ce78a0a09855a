"""Checkpoint IO plugins of the lightning_dist strategies: the shared base and the synchronous sharded one.

Every rank calls ``save_checkpoint`` with the same path. What lands on disk is described in
:mod:`lightning_dist.checkpoint.layout`; loading is done by the strategy (it needs the model), which reads either
format whatever plugin is configured, so a checkpoint written with one plugin resumes with another.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_dist.checkpoint.integrity import (
    FileRecord,
    checksumming_writer,
    gather_records,
    record_of_bytes,
    records_of,
    verify_checksums,
    write_marker,
)
from lightning_dist.checkpoint.layout import (
    METADATA_FILENAME,
    PROVENANCE_KEY,
    CheckpointError,
    check_replaceable,
    foreign_content,
    new_token,
    publish,
    read_checkpoint_file,
    read_metadata,
    remove_own_checkpoint,
    temporary_path,
    with_provenance,
)
from lightning_dist.checkpoint.recovery import prepare_target
from lightning_dist.checkpoint.safe_load import resolve_weights_only
from lightning_dist.checkpoint.save_failures import save_failure
from lightning_dist.checkpoint.state_paths import SAVED_STATES_KEY, model_state_paths, pop_path, set_path
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.compat.lightning import StrOrPath

__all__ = ["CheckpointError", "DistributedCheckpointIO", "ParallelCheckpointIO"]


class ParallelCheckpointIO(CheckpointIO):
    """Base of the checkpoint IO plugins a lightning_dist strategy accepts.

    Subclasses say which state they want from the strategy (:attr:`full_state`) and may save asynchronously
    (:meth:`wait`, :meth:`check`).
    """

    #: ``False``: the strategy hands over sharded (DTensor) states; ``True``: full states on rank 0.
    full_state: ClassVar[bool] = False

    @override
    def load_checkpoint(
        self, path: StrOrPath, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict:
        """A single file as a whole; for a sharded folder, everything but the model and optimizer states (only a
        strategy holding the model can load those). ``weights_only=None`` is torch's default for local files
        (``True``: nothing but tensors and plain data is unpickled)."""
        safe = resolve_weights_only(weights_only)
        path = validate_checkpoint(path, safe)
        if path.is_dir():
            return read_metadata(path, safe)
        verify_checksums(path, safe)
        return read_checkpoint_file(path, safe, map_location=map_location or "cpu")

    @override
    def remove_checkpoint(self, path: StrOrPath) -> None:
        remove_checkpoint_if_ours(Path(path))

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; raise if it failed. Collective."""

    def check(self) -> None:
        """Raise on every rank if a save in flight has failed (called at the start of each training step)."""


class DistributedCheckpointIO(ParallelCheckpointIO):
    """Sharded checkpoints through ``torch.distributed.checkpoint``: every rank writes its own shards, in parallel,
    into one folder; ``meta.pt`` beside them holds the rest of Lightning's checkpoint. The default of every
    lightning_dist strategy. Resumes on any number of ranks and under any lightning_dist strategy.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: StrOrPath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        path = Path(path)
        sharded, meta = split_sharded(checkpoint)
        tmp = start_folder(path)
        writer = self._storage_writer(tmp)
        try:
            dcp.save(sharded, storage_writer=writer)  # every rank returns or raises, once every rank's writes ended
        except (Exception, dcp.CheckpointException) as err:
            raise shared_save_failure(path, tmp, err) from err
        records = gather_records(records_of(writer))
        on_rank_zero_then_check(lambda: finish_folder(tmp, path, meta, records), f"publish the checkpoint at {path}")

    def _storage_writer(self, folder: Path) -> dcp.StorageWriter:
        """DCP's file system writer, recording the checksum of every file it writes."""
        return checksumming_writer(folder)


def split_sharded(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split Lightning's checkpoint dict into DCP's sharded part and the metadata that goes to ``meta.pt``.

    Every model state goes to DCP: ``state_dict`` and, with weight averaging, the others of
    :func:`~lightning_dist.checkpoint.state_paths.model_state_paths`, which ``meta.pt``'s provenance entry then
    lists."""
    meta = dict(with_provenance(checkpoint))
    sharded: dict[str, Any] = {}
    paths = model_state_paths(meta)
    for path in paths:
        set_path(sharded, path, pop_path(meta, path))
    if len(paths) > 1:
        meta[PROVENANCE_KEY] = {**meta[PROVENANCE_KEY], SAVED_STATES_KEY: [list(path) for path in paths]}
    for idx, optim_state in enumerate(meta.pop("optimizer_states", [])):
        sharded[f"optimizer_{idx}"] = optim_state
    return sharded, meta


def start_folder(path: Path) -> Path:
    """Create (on rank 0) the temporary folder a sharded save writes into; returns it on every rank. Collective."""
    tmp = temporary_path(path, shared_token())

    def create() -> None:
        check_replaceable(path)
        prepare_target(path)
        try:
            tmp.mkdir(parents=True, exist_ok=False)
        except OSError as err:
            raise save_failure(path, err, tmp) from err

    on_rank_zero_then_check(create, f"create {tmp}")
    return tmp


def finish_folder(tmp: Path, path: Path, meta: dict[str, Any] | bytes, records: dict[str, FileRecord]) -> None:
    """Write ``meta.pt`` and the completion marker, with the checksums of every file (``records``: the shards and
    DCP index), into ``tmp``, then publish it at ``path`` (rank 0 only)."""
    meta_bytes = meta if isinstance(meta, bytes) else serialize(meta)
    try:
        (tmp / METADATA_FILENAME).write_bytes(meta_bytes)
        write_marker(tmp, {**records, METADATA_FILENAME: record_of_bytes(meta_bytes)})
        publish(tmp, path)
    except OSError as err:
        raise save_failure(path, err, tmp) from err


def shared_save_failure(path: Path, tmp: Path, error: BaseException) -> CheckpointError:
    """After a collective write into ``tmp`` failed on some rank (every rank has the error): rank 0 removes the
    partial folder; every rank gets rank 0's :class:`CheckpointError` naming ``path`` and the cause. Collective."""
    message: list[str | None] = [str(save_failure(path, error, tmp)) if rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(message, src=0)
    return CheckpointError(message[0])


def serialize(obj: Any) -> bytes:
    """``torch.save`` into bytes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def remove_checkpoint_if_ours(path: Path) -> None:
    """ModelCheckpoint dropping an older top-k or ``last``: delete it only if it is one of our own checkpoints."""
    if not remove_own_checkpoint(path):
        rank_zero_warn(
            f"Not deleting {str(path)!r} (ModelCheckpoint asked to, replacing it): {foreign_content(path)}, and"
            " lightning_dist deletes only its own checkpoints."
        )


def on_rank_zero_then_check(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on rank 0 and raise on *every* rank if it failed, so no rank waits forever for rank 0.

    A :class:`CheckpointError` (a refusal that explains itself) is raised with its own message; anything else says
    what rank 0 was doing.
    """
    error: list[str | None] = [None]
    if rank() == 0:
        try:
            fn()
        except CheckpointError as err:
            error[0] = str(err)
        except Exception as err:  # noqa: BLE001 (re-raised on every rank below)
            error[0] = f"Rank 0 could not {what}: {type(err).__name__}: {err}"
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(error[0])


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def shared_token() -> str:
    """A random token, the same on every rank. Collective."""
    token = [new_token()]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    return token[0]
