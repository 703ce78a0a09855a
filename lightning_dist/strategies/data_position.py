"""Resuming mid-epoch at the right batch.

Without help, Lightning resumes a mid-epoch checkpoint at the first batch of that epoch (unless the dataloader
itself is stateful). The strategy records, in its own checkpoint entry, the epoch, how many batches the training
loop has *processed* in it (not how many were fetched: Lightning prefetches), the per-rank batch sizes and the
number of data-parallel replicas. On resume each training sampler skips exactly the samples already trained on,
once. No batch is loaded twice, the order is the interrupted run's (a seeded sampler's for that epoch), it works on
another number of replicas, and the checkpoint stays loadable by a plain one-device Lightning run.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

#: Lightning's warning for mid-epoch resumes without a stateful dataloader (the strategy restores the position).
LIGHTNING_NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


def training_position(trainer: pl.Trainer, replicas: int) -> dict[str, Any]:
    """Where the training loop is: the epoch, the batches it has finished in it, and how big those batches were."""
    return {
        "epoch": trainer.current_epoch,
        "batches_processed": trainer.fit_loop.epoch_loop.batch_progress.current.processed,
        "batches_per_epoch": trainer.num_training_batches,
        "batch_sizes": [getattr(dl, "batch_size", None) for dl in flatten_loaders(trainer.train_dataloader)],
        "replicas": replicas,
    }


def skip_trained_batches(dataloader: object, position: dict[str, Any], index: int, replicas: int) -> bool:
    """Make the next pass over the ``index``-th training dataloader start where the run recorded in ``position``
    stopped; ``replicas`` is the current number of data-parallel replicas. Returns whether a skip was installed."""
    processed = int(position["batches_processed"])
    if processed <= 0 or processed >= position["batches_per_epoch"]:
        return False  # at an epoch boundary: the next epoch starts at its first batch anyway
    if isinstance(dataloader, _Stateful):
        return False  # a stateful dataloader: Lightning restores its position itself
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if (
        not isinstance(dataloader, DataLoader)
        or isinstance(dataloader.dataset, IterableDataset)
        or type(batch_sampler) is not BatchSampler
    ):
        return _cannot_skip(
            processed, "it has no sampler with a plain batch_size (an IterableDataset or a custom batch_sampler)"
        )
    sizes = position.get("batch_sizes") or []
    saved_size = sizes[index] if index < len(sizes) and sizes[index] else batch_sampler.batch_size
    saved_replicas = int(position.get("replicas", replicas))
    consumed = processed * saved_size * saved_replicas  # samples of the epoch, over all replicas
    if consumed % replicas:
        return _cannot_skip(
            processed,
            f"{consumed} samples were consumed over {saved_replicas} replicas, which {replicas} replicas"
            " cannot split evenly",
        )
    _set_sampler_epoch(dataloader, position["epoch"])
    batch_sampler.sampler = _SkipOnce(batch_sampler.sampler, consumed // replicas)
    return True


def flatten_loaders(loaders: Any) -> list[Any]:
    """The dataloaders in what ``trainer.train_dataloader`` returns (one, or a list/dict of them)."""
    if isinstance(loaders, Mapping):
        return [dl for value in loaders.values() for dl in flatten_loaders(value)]
    if isinstance(loaders, (list, tuple)):
        return [dl for value in loaders for dl in flatten_loaders(value)]
    return [] if loaders is None else [loaders]


def _cannot_skip(processed: int, why: str) -> bool:
    rank_zero_warn(
        f"Resuming mid-epoch, but lightning_dist cannot skip the {processed} batches already trained on in this epoch"
        f" for a training dataloader: {why}. They will be seen again. Save checkpoints at epoch ends to avoid this."
    )
    return False


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
        if name.startswith("__") or name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)
