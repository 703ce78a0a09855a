"""Resuming mid-epoch at the right batch.

Without help, Lightning resumes a mid-epoch checkpoint at the first batch of that epoch (unless the dataloader
itself is stateful). The strategy records, in its own checkpoint entry, the epoch and how many batches the training
loop has *processed* in it (not how many were fetched: Lightning prefetches), and on resume makes the training
sampler skip exactly those samples once. No batch is loaded twice, the order is the interrupted run's (a seeded
sampler's for that epoch), and the checkpoint stays loadable by a plain one-device Lightning run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, Sampler

#: Lightning's warning for mid-epoch resumes without a stateful dataloader (the strategy restores the position).
LIGHTNING_NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


def training_position(trainer: pl.Trainer) -> dict[str, Any]:
    """Where the training loop is: the epoch and the batches it has finished in it."""
    return {
        "epoch": trainer.current_epoch,
        "batches_processed": trainer.fit_loop.epoch_loop.batch_progress.current.processed,
        "batches_per_epoch": trainer.num_training_batches,
    }


def skip_trained_batches(dataloader: object, position: dict[str, Any]) -> None:
    """Make the next pass over ``dataloader`` start where the run recorded in ``position`` stopped."""
    processed = int(position["batches_processed"])
    if processed <= 0 or processed >= position["batches_per_epoch"]:
        return  # at an epoch boundary: the next epoch starts at its first batch anyway
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if not isinstance(dataloader, DataLoader) or type(batch_sampler) is not BatchSampler:
        rank_zero_warn(
            "Resuming mid-epoch, but the training dataloader has no plain batch_size/sampler, so lightning_dist cannot"
            f" skip the {processed} batches already trained on in this epoch; they will be seen again. Save"
            " checkpoints at epoch ends, or use a DataLoader with batch_size."
        )
        return
    _set_sampler_epoch(dataloader, position["epoch"])
    batch_sampler.sampler = _SkipOnce(batch_sampler.sampler, processed * batch_sampler.batch_size)


class _SkipOnce(Sampler):
    """Yields ``sampler``'s indices, dropping the first ``count`` once (on the next pass only)."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler = sampler
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        count, self.count = self.count, 0
        return itertools.islice(iter(self.sampler), count, None)

    def __len__(self) -> int:
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:  # set_epoch and friends reach the real sampler
        return getattr(self.sampler, name)
