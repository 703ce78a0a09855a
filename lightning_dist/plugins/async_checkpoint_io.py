"""Sharded checkpoints saved in the background while training goes on."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from typing_extensions import override

from lightning_dist.checkpoint.integrity import gather_records, records_of
from lightning_dist.checkpoint.layout import CheckpointError, remove
from lightning_dist.checkpoint.save_failures import save_failure
from lightning_dist.compat.lightning import StrOrPath
from lightning_dist.plugins.checkpoint_io import (
    DistributedCheckpointIO,
    finish_folder,
    rank,
    remove_checkpoint_if_ours,
    serialize,
    split_sharded,
    start_folder,
)


class AsyncDistributedCheckpointIO(DistributedCheckpointIO):
    """Like :class:`DistributedCheckpointIO` (same folder, same atomic publish), but the write happens in a background
    thread: ``save_checkpoint`` returns once the state is copied to CPU memory, and training continues.

    * A second save, or the end of training, waits for the one in flight.
    * A failed write (on any rank) is raised on every rank at the start of the next training step, at the next save
      or at teardown, never ignored.
    * ModelCheckpoint's deletion of an older checkpoint waits until the new one is published, so ``last`` and the
      top-k always point at complete checkpoints.

    Args:
        pinned_memory: Stage GPU tensors in pinned CPU memory (faster device-to-host copies; CUDA only).
        timeout: Timeout of the save's own process group (a gloo group, so that the background thread's
            collectives never interleave with training's).
    """

    def __init__(self, pinned_memory: bool = False, timeout: timedelta = timedelta(minutes=30)) -> None:
        super().__init__()
        self.pinned_memory = pinned_memory
        self.timeout = timeout
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._removals: list[Path] = []
        self._save_group: dist.ProcessGroup | None = None
        self._status_group: dist.ProcessGroup | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: StrOrPath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        self.wait()
        self._ensure_groups()
        path = Path(path)
        sharded, meta = split_sharded(checkpoint)
        tmp = start_folder(path)
        stager = DefaultStager(StagingOptions(self._pin(), False, False, False))
        error = None
        try:
            # Copies, now: training changes the parameters, loops and callbacks as soon as this returns.
            meta_bytes = serialize(meta)
            staged = stager.stage(sharded)
        except Exception as err:  # noqa: BLE001 (every rank learns of it below, before any rank starts writing)
            error = str(save_failure(path, err))
        if self._any_error(error):  # collective: called on every rank, failed or not
            stager.close()
            if rank() == 0:
                remove(tmp)
            self._raise_on_every_rank(error)
        writer, group, is_rank_zero = self._storage_writer(tmp), self._save_group, rank() == 0

        def write() -> None:
            try:
                try:
                    dcp.save(staged, storage_writer=writer, process_group=group)  # collective over the save group
                finally:
                    stager.close()
                records = gather_records(records_of(writer), group)  # collective over the save group
            except (Exception, dcp.CheckpointException) as err:
                # Every rank has DCP's error once every rank's writes ended: rank 0 removes the partial folder.
                raise save_failure(path, err, tmp if is_rank_zero else None) from err
            if is_rank_zero:
                finish_folder(tmp, path, meta_bytes, records)  # a CheckpointError, the folder removed, if it fails

        assert self._executor is not None
        self._pending = self._executor.submit(write)

    @override
    def remove_checkpoint(self, path: StrOrPath) -> None:
        # Called on rank 0 right after a save returns (ModelCheckpoint replacing an older top-k or `last`): delete
        # the old checkpoint only once the new one is published, and keep it if the new save fails.
        if self._pending is not None:
            self._removals.append(Path(path))
        else:
            remove_checkpoint_if_ours(Path(path))

    @override
    def wait(self) -> None:
        if self._pending is None:
            return
        error = _error_of(self._pending, block=True)
        self._settle(self._any_error(error), error)

    @override
    def check(self) -> None:
        if self._pending is None:
            return
        done = self._pending.done()
        error = _error_of(self._pending, block=False) if done else None
        if not dist.is_initialized():
            if done:
                self._settle(error is not None, error)
            return
        flags = torch.tensor([0 if done else 1, 1 if error else 0])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._status_group)
        if not flags[0]:  # every rank's part has finished
            self._settle(bool(flags[1]), error)

    @override
    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _settle(self, failed: bool, error: str | None) -> None:
        """The save in flight has finished on every rank: run or drop the deferred deletions, raise if it failed."""
        self._pending = None
        removals, self._removals = self._removals, []
        if failed:
            self._raise_on_every_rank(error)
        for path in removals:
            remove_checkpoint_if_ours(path)

    def _any_error(self, error: str | None) -> bool:
        """Whether any rank has an error (collective over the status group)."""
        if not dist.is_initialized():
            return error is not None
        flag = torch.tensor([1 if error else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._status_group)
        return bool(flag)

    def _raise_on_every_rank(self, error: str | None) -> None:
        """Raise the same :class:`CheckpointError` on every rank: the first failing rank's message (its first line
        names the checkpoint and the cause), and the other failing ranks' first lines. Collective."""
        errors: list[str | None] = [error]
        if dist.is_initialized():
            gathered: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, error, group=self._status_group)
            errors = gathered
        failures = [(r, e) for r, e in enumerate(errors) if e]
        first_rank, message = failures[0]
        others = [f"rank {r}: {e.splitlines()[0]}" for r, e in failures[1:]]
        background = f"(A background save: rank {first_rank} reported this at the first step or save after it failed.)"
        raise CheckpointError("\n".join([message, *others, background]))

    def _ensure_groups(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_dist-ckpt")
        if dist.is_initialized() and self._save_group is None:
            # Collective: every rank saves, so every rank creates the groups here, in the same order.
            self._save_group = dist.new_group(backend="gloo", timeout=self.timeout)
            self._status_group = dist.new_group(backend="gloo", timeout=self.timeout)

    def _pin(self) -> bool:
        if self.pinned_memory and not torch.cuda.is_available():
            rank_zero_warn("AsyncDistributedCheckpointIO(pinned_memory=True) needs CUDA; staging in ordinary memory.")
            return False
        return self.pinned_memory


def _error_of(future: Future, block: bool) -> str | None:
    if not block and not future.done():
        return None
    err = future.exception()
    if err is None:
        return None
    return str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
