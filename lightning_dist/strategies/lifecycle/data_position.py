"""Resuming mid-epoch at the right batch.

Without help, Lightning resumes a mid-epoch checkpoint at the first batch of that epoch (unless the dataloader
itself is stateful). The strategy records, in its own checkpoint entry, the epoch, how many batches the training
loop has *processed* in it (not how many were fetched: Lightning prefetches), the per-rank batch sizes and the
number of data-parallel replicas. On resume each training sampler skips exactly the samples already trained on,
once. No batch is loaded twice, the order is the interrupted run's (a seeded sampler's for that epoch), it works on
another number of replicas, and the checkpoint stays loadable by a plain one-device Lightning run.

The epoch and batch count come from Lightning's loop counters, settled first (see :mod:`.loop_position`): once its fit
loop has counted an epoch as processed (at epoch end, or when ``fit`` returned), its own epoch counter is one ahead
of the batches' epoch when the epoch was cut short.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from lightning_dist.compat.lightning import Stateful, set_sampler_epoch
from lightning_dist.strategies.lifecycle.loop_position import settle_fit_loop

#: Lightning's warning for mid-epoch resumes without a stateful dataloader (the strategy restores the position).
LIGHTNING_NOT_RESUMABLE_WARNING = r"You're resuming from a checkpoint that ended before the epoch ended"


def training_position(trainer: pl.Trainer, checkpoint: dict[str, Any], replicas: int) -> dict[str, Any]:
    """Where the training loop is: the epoch its next batch belongs to, the batches it has finished in that epoch,
    and how big those batches were. Settles the loop counters in ``checkpoint`` (a copy of them) to agree."""
    batches_per_epoch = trainer.num_training_batches
    if isinstance(checkpoint.get("loops"), dict) and "fit_loop" in checkpoint["loops"]:
        checkpoint["loops"] = {**checkpoint["loops"], "fit_loop": copy.deepcopy(checkpoint["loops"]["fit_loop"])}
    settled = settle_fit_loop(checkpoint.get("loops"), batches_per_epoch)
    if settled is None:  # no loop state in the checkpoint: the live counters (the epoch may be one ahead, see above)
        settled = trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.processed
    else:  # Lightning's own field follows its counters
        checkpoint["epoch"] = checkpoint["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"]
    return {
        "epoch": settled[0],
        "batches_processed": settled[1],
        "batches_per_epoch": batches_per_epoch if math.isfinite(batches_per_epoch) else None,
        "batch_sizes": [getattr(dl, "batch_size", None) for dl in flatten_loaders(trainer.train_dataloader)],
        "replicas": replicas,
    }


def resume_position(checkpoint: dict[str, Any], recorded: dict[str, Any] | None) -> dict[str, Any] | None:
    """The position a resume starts from: ``recorded`` (the strategy's ``data_position`` entry) with its epoch and
    batch count taken from the checkpoint's loop counters, settled in place first (checkpoints saved before they
    were settled recorded the epoch after ``fit`` returned one too far). A checkpoint without a recorded position
    (saved without lightning_dist, or outside ``fit``) has no batch sizes: a mid-epoch position then has ``replicas`` unset and is reported, not skipped."""
    settled = settle_fit_loop(checkpoint.get("loops"), (recorded or {}).get("batches_per_epoch"))
    if settled is None:
        return recorded
    position = dict(recorded or {})
    position["epoch"], position["batches_processed"] = settled
    return position


def skip_trained_batches(dataloader: object, position: dict[str, Any], index: int, replicas: int) -> bool:
    """Make the next pass over the ``index``-th training dataloader start where the run recorded in ``position``
    stopped; ``replicas`` is the current number of data-parallel replicas. Returns whether a skip was installed."""
    processed = int(position["batches_processed"])
    if processed <= 0 or processed >= (position.get("batches_per_epoch") or math.inf):
        return False  # at an epoch boundary: the next epoch starts at its first batch anyway
    if isinstance(dataloader, Stateful):
        return False  # a stateful dataloader: Lightning restores its position itself
    if "replicas" not in position:
        return _cannot_skip(
            processed,
            "the checkpoint records no data position (it was saved without lightning_dist, or outside trainer.fit),"
            " so how big its batches were is unknown",
        )
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
    set_sampler_epoch(dataloader, position["epoch"])
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
