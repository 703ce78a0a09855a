"""Tensor, context and pipeline peers must read the same batch (a mixin of the step protocol).

Ranks that differ only in tp, cp or pp split one model, not the data: each needs the whole batch of its data-parallel
rank. Lightning's DistributedSampler, given :attr:`distributed_sampler_kwargs`, splits over data-parallel ranks only;
a loader that splits by ``torch.distributed.get_rank()`` / ``get_world_size()`` (an iterable dataset's own sharding,
a ``DistributedSampler`` built with ``num_replicas=trainer.world_size``) splits over the peers as well, and the run
trained on mismatched halves without a word (tp peers summed partial results of different inputs; the pipeline's
last stage scored one batch's outputs against another's labels). The first batch of each loop (training,
validation, test, predict, sanity check) is compared between peers, a small fingerprint per rank in one all-gather;
a difference stops every rank at once with what to change.

``seed_everything(seed, workers=True)`` seeds each dataloader worker from the global rank (Lightning's
``pl_worker_init_function``), so random transforms in workers drew differently on peers; here workers are seeded from
the data-parallel rank instead, as Lightning would seed them with one rank per data-parallel rank.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.seed import pl_worker_init_function
from typing_extensions import override

from lightning_dist.compat.lightning import attached_trainer
from lightning_dist.parallel.batch_fingerprint import BatchFingerprint, batch_fingerprint


class PeerBatchMismatchError(RuntimeError):
    """Ranks of one data-parallel rank (tensor, context or pipeline peers) read different batches."""


class PeerBatches:
    """Compares the first batch of each loop between the ranks of one data-parallel rank."""

    _peer_checked_loops: frozenset[str] = frozenset()

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        if self._has_batch_peers():
            seed_workers_by_data_parallel_rank(dataloader, self.distributed_sampler_kwargs["rank"])  # type: ignore[attr-defined]
        return dataloader

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]
        loop = self._current_loop()
        if loop is not None and loop not in self._peer_checked_loops:  # once per loop, then nothing per batch
            self._peer_checked_loops = self._peer_checked_loops | {loop}
            if self._has_batch_peers():
                self.check_peer_batches(batch, loop)
        return batch

    def _current_loop(self) -> str | None:
        trainer = attached_trainer(getattr(self, "lightning_module", None))
        stage = trainer.state.stage if trainer is not None else None
        return stage.value if stage is not None else None

    def _has_batch_peers(self) -> bool:
        if not dist.is_initialized() or getattr(self, "_mesh", None) is None:
            return False
        dims = self.parallel_dims  # type: ignore[attr-defined]
        return dims.tp * dims.cp * dims.pp > 1

    def check_peer_batches(self, batch: Any, loop: str) -> None:
        """Raise :class:`PeerBatchMismatchError` on every rank when peers read different batches (collective)."""
        mine = (self.distributed_sampler_kwargs["rank"], batch_fingerprint(batch))  # type: ignore[attr-defined]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        mesh = str(self.parallel_dims)  # type: ignore[attr-defined]
        first: dict[int, tuple[int, BatchFingerprint]] = {}
        for rank, (dp_rank, fingerprint) in enumerate(every):
            seen = first.setdefault(dp_rank, (rank, fingerprint))
            if not seen[1].same_batch(fingerprint):
                raise PeerBatchMismatchError(_mismatch_message(seen[0], rank, dp_rank, loop, mesh))


def seed_workers_by_data_parallel_rank(dataloader: object, rank: int) -> None:
    """Seed ``dataloader``'s workers as Lightning does under ``seed_everything(workers=True)``, from the data-parallel
    ``rank`` instead of the global one: the Trainer adds its worker seeding after the strategy saw the loader (here
    it is added first), Fabric before (here it is replaced). A ``worker_init_fn`` of the user's own is kept."""
    current = getattr(dataloader, "worker_init_fn", False)
    lightnings = isinstance(current, partial) and current.func is pl_worker_init_function
    if lightnings or (current is None and int(os.environ.get("PL_SEED_WORKERS", "0"))):
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=rank)  # type: ignore[attr-defined]


_LOOP_NAMES = {"train": "training", "sanity_check": "sanity-check", "validate": "validation"}


def _mismatch_message(first: int, other: int, dp_rank: int, loop: str, mesh: str) -> str:
    step = _LOOP_NAMES.get(loop, loop)
    return (
        f"Ranks {first} and {other} read different batches in their first {step} step, but they are tensor, context"
        f" or pipeline peers (data-parallel rank {dp_rank} of the mesh {mesh}): they split one model, so each needs"
        " the same whole batch. Split the data over data-parallel ranks only: Lightning's DistributedSampler does"
        " (use_distributed_sampler=True, the default, with a map-style dataset); a sampler or an iterable dataset"
        " of your own should take num_replicas and rank from trainer.strategy.distributed_sampler_kwargs, not"
        " torch.distributed.get_rank()/get_world_size() or trainer.global_rank/world_size. Random transforms in"
        " the dataset must draw the same on peers too."
    )
