"""Loaders that split data in ways tensor, context and pipeline peers must not see, as users write them.

- ``rank_stream_<strategy>``: an ``IterableDataset`` that shards itself by ``torch.distributed.get_rank()`` /
  ``get_world_size()`` (the usual recipe for streams), under a mesh with peers: refused at the first batch; under
  fsdp2 (every rank a data-parallel rank) it trains.
- ``worker_seeds_<strategy>``: ``seed_everything(0, workers=True)`` and a map-style dataset whose ``__getitem__``
  draws a random shift in a worker process (a random augmentation), fp64: the losses, which one process gives too.

python tests/scenarios/peer_batch_runs.py --devices 2 --out r.json --workdir DIR --scenarios rank_stream_tensor_parallel
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import ALL_RANKS, StepRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from lightning_dist.parallel.batch_fingerprint import batch_fingerprint
from lightning_dist.strategies.lifecycle.peer_batches import PeerBatchMismatchError

SEQ = 32
STEPS = 3


def _tokens(index: int) -> torch.Tensor:
    return torch.randint(0, 64, (SEQ + 1,), generator=torch.Generator().manual_seed(index))


class RankShardedStream(IterableDataset):
    """Every ``world_size``-th sample from this rank's index, as stream recipes shard."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        for index in range(rank, 64, world):
            tokens = _tokens(index)
            yield {"input_ids": tokens[:-1], "labels": tokens[1:]}


class RandomlyShifted(Dataset):
    """Token sequences rolled by a random shift drawn in ``__getitem__`` (a random augmentation)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.roll(_tokens(index), int(torch.randint(0, SEQ, (1,))))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


def _rank_stream(devices: int, workdir: str, strategy: str) -> dict[str, Any]:
    model, _ = make_model_and_data(devices, dp_size=1, vocab_size=64)
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=ALL_RANKS[strategy][0](devices), limit_val_batches=0), max_steps=STEPS
    )
    try:
        trainer.fit(model, DataLoader(RankShardedStream(), batch_size=4))
        return {"error": None, "steps": trainer.global_step}
    except PeerBatchMismatchError as error:
        return {"error": str(error), "steps": trainer.global_step}


def _worker_seeds(devices: int, workdir: str, strategy: str) -> dict[str, Any]:
    model, _ = make_model_and_data(devices, dp_size=1, vocab_size=64)
    L.seed_everything(0, workers=True)
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=ALL_RANKS[strategy][0](devices), limit_val_batches=0, precision="64-true"),
        max_steps=STEPS,
        callbacks=[recorder],
    )
    dataset = RandomlyShifted()
    # one process: the order Lightning's DistributedSampler gives the tp run (it shuffles training data, seed 0)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=0) if devices == 1 else None
    trainer.fit(model.double(), DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=1))
    return {"losses": recorder.losses}


def _fabric_worker_seeds(devices: int, workdir: str, strategy: str) -> dict[str, Any]:
    """The same augmented loader in a Fabric loop (litgpt's style): the first batches' digests on every rank and the
    losses, fp64 (the default dtype too: Fabric's own 64-true casts outputs to it)."""
    torch.set_default_dtype(torch.float64)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision="64-true")
    fabric.launch()
    model, _ = make_model_and_data(devices, dp_size=1, vocab_size=64)
    fabric.seed_everything(0, workers=True)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = fabric.setup_dataloaders(DataLoader(RandomlyShifted(), batch_size=4, num_workers=1))
    losses, digests = [], []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        digests.append(batch_fingerprint(batch).exact)
        logits = model(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    ranks = fabric.all_gather(torch.tensor(digests)).tolist() if devices > 1 else [digests]
    return {"losses": losses, "digests": ranks}


_NAMES = ("fsdp2", "tensor_parallel", "pipeline", "context_parallel", "one_process")

SCENARIOS = {
    "fabric_worker_seeds_tensor_parallel": lambda d, w: _fabric_worker_seeds(d, w, "tensor_parallel"),
    "fabric_worker_seeds_one_process": lambda d, w: _fabric_worker_seeds(d, w, "auto"),
    **{f"rank_stream_{name}": lambda d, w, name=name: _rank_stream(d, w, name) for name in _NAMES},
    **{f"worker_seeds_{name}": lambda d, w, name=name: _worker_seeds(d, w, name) for name in _NAMES},
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
