"""The baselines ``fsdp2`` and ``tensor_parallel`` are measured against.

* :class:`HandShardedGPT` — what a user writes for Lightning's ``ModelParallelStrategy`` today: a
  ``configure_model`` that applies ``fully_shard`` to each block, then the root.
* :class:`HandTensorParallelGPT` — the hand-written ``parallelize_module`` plan (Megatron-style column/row pairs) for
  ``ModelParallelStrategy``, with ``fully_shard`` over the data-parallel mesh dimension when it is larger than 1 (2-D).
* :func:`raw_fsdp_loop` — a plain PyTorch training loop with ``fully_shard`` and no Lightning at all.

The model code is the example GPT unchanged; only ``configure_model`` is added, as a user would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler

from examples.gpt import GPT

TP_PLAN = {
    "attn.query": ColwiseParallel,
    "attn.key": ColwiseParallel,
    "attn.value": ColwiseParallel,
    "attn.proj": RowwiseParallel,
    "mlp.up": ColwiseParallel,
    "mlp.down": RowwiseParallel,
}


def shard_blocks_and_root(model: GPT, mesh: DeviceMesh) -> None:
    """``fully_shard`` every transformer block, then the root (FSDP2's defaults otherwise)."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


class HandShardedGPT(GPT):
    """The example GPT with a hand-written FSDP2 ``configure_model`` (for ``ModelParallelStrategy``)."""

    def configure_model(self) -> None:
        shard_blocks_and_root(self, self.device_mesh["data_parallel"])


class HandTensorParallelGPT(GPT):
    """The example GPT with a hand-written tensor-parallel plan (for ``ModelParallelStrategy``).

    Attention/MLP input projections are column-parallel, output projections row-parallel; each rank then runs
    ``n_head / tp`` heads, so the head count the attention module reshapes with is divided by the TP size.
    Embeddings, norms and the head stay replicated.
    """

    def configure_model(self) -> None:
        tp_mesh = self.device_mesh["tensor_parallel"]
        for block in self.blocks:
            parallelize_module(block, tp_mesh, {name: style() for name, style in TP_PLAN.items()})
            block.attn.n_head //= tp_mesh.size()
        dp_mesh = self.device_mesh["data_parallel"]
        if dp_mesh.size() > 1:
            shard_blocks_and_root(self, dp_mesh)


def raw_fsdp_loop(
    model: GPT,
    dataset: torch.utils.data.Dataset,
    batch_size: int,
    steps: int,
    device: torch.device,
    seed: int,
    on_step_start: Callable[[int, Any, list[torch.optim.Optimizer]], None],
    on_step_end: Callable[[int, Any, list[torch.optim.Optimizer]], None],
) -> None:
    """Train ``model`` for ``steps`` optimizer steps with ``fully_shard`` and a hand-written loop.

    The loop does what Lightning does per step for this model: forward, ``zero_grad``, backward, AdamW + LR
    scheduler step, and an all-reduce of the loss for logging (the GPT logs it with ``sync_dist=True``). The data
    are sharded with the same ``DistributedSampler`` (shuffle, seed) Lightning injects.

    Args:
        model: The (unsharded) GPT; sharded in place over all ranks.
        dataset: Training samples (``input_ids``, ``labels``).
        batch_size: Samples per rank per step.
        steps: Optimizer steps to run.
        device: This rank's device.
        seed: Sampler seed.
        on_step_start: Called with ``(step, model, optimizers)`` once the batch is on the device.
        on_step_end: Called with ``(step, model, optimizers)`` after the optimizer step.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    model.to(device)
    shard_blocks_and_root(model, init_device_mesh(device.type, (world,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=model.hparams.lr, weight_decay=model.hparams.weight_decay)
    warmup = max(1, model.hparams.warmup_steps)
    total = max(steps, warmup + 1)

    def schedule(step: int) -> float:  # the same schedule as GPT.configure_optimizers
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    model.train()
    step = 0
    while step < steps:
        for batch in loader:
            if step >= steps:
                break
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            on_step_start(step, model, [optimizer])
            loss, _ = model._loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            on_step_end(step, model, [optimizer])
            step += 1
