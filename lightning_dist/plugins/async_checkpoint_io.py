"""Sharded checkpoints saved in the background while training goes on."""

from __future__ import annotations

import io
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from typing_extensions import override

from lightning_dist.checkpoint.layout import CheckpointError, remove
from lightning_dist.plugins.checkpoint_io import (
    DistributedCheckpointIO,
    finish_folder,
    rank,
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
        self._save_group: dist.ProcessGroup | None = None
        self._status_group: dist.ProcessGroup | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        self.wait()
        self._ensure_groups()
        path = Path(path)
        sharded, meta = split_sharded(checkpoint)
        meta_bytes = _serialize(meta)  # now: the loops and callbacks keep changing after this returns
        tmp = start_folder(path)
        stager = DefaultStager(StagingOptions(self._pin(), False, False, False))
        upload = dcp.async_save(
            sharded, storage_writer=self._storage_writer(tmp), process_group=self._save_group, async_stager=stager
        )
        is_rank_zero = rank() == 0

        def finish() -> None:
            try:
                upload.result()  # DCP's own collective finish: every rank's shards are written when this returns
            finally:
                stager.close()
            if is_rank_zero:
                finish_folder(tmp, path, meta_bytes)

        assert self._executor is not None
        self._pending = self._executor.submit(finish)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        # Called on rank 0 right after a save returns: delete the old checkpoint only once the new one is published.
        if self._pending is not None and self._executor is not None:
            self._executor.submit(remove, Path(path))
        else:
            remove(Path(path))

    @override
    def wait(self) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        error = _error_of(pending, block=True)
        self._raise_on_every_rank(error)

    @override
    def check(self) -> None:
        if self._pending is None:
            return
        done = self._pending.done()
        error = _error_of(self._pending, block=False) if done else None
        if self._agree(done, error):
            self._pending = None

    @override
    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _agree(self, done: bool, error: str | None) -> bool:
        """All ranks learn whether every rank's part of the save has finished, and whether any failed."""
        if not dist.is_initialized():
            if error:
                raise CheckpointError(f"The background checkpoint save failed: {error}")
            return done
        flags = torch.tensor([0 if done else 1, 1 if error else 0])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._status_group)
        any_running, any_failed = bool(flags[0]), bool(flags[1])
        if any_failed:
            self._pending = None
            self._raise_on_every_rank(error)
        return not any_running

    def _raise_on_every_rank(self, error: str | None) -> None:
        errors: list[str | None] = [error]
        if dist.is_initialized():
            gathered: list[str | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, error, group=self._status_group)
            errors = gathered
        failures = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        if failures:
            raise CheckpointError(
                "The background checkpoint save failed; the previous checkpoint is still in place. "
                + "; ".join(failures)
            )

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


def _serialize(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _error_of(future: Future, block: bool) -> str | None:
    if not block and not future.done():
        return None
    err = future.exception()
    return None if err is None else f"{type(err).__name__}: {err}"
