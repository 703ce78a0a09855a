"""Replicated copies stay bitwise identical across ranks, seed or no seed: tensor parallelism (parameters tp leaves
whole) and HSDP (one copy of each shard per replica group).

python tests/scenarios/replica_runs.py --devices 2 --out r.json --workdir DIR --scenarios tp_unseeded,...
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor, Replicate

from lightning_dist import FSDP2Strategy, TensorParallelStrategy


def _whole_on_every_rank(p: torch.Tensor) -> bool:
    """Plain tensors and all-replicated DTensors: what every rank holds a full copy of."""
    return not isinstance(p, DTensor) or all(isinstance(pl, Replicate) for pl in p.placements)


def _cross_rank_difference(model: torch.nn.Module, select: Callable[[torch.Tensor], bool]) -> float:
    """Largest |difference| between rank 0's and any rank's copy of the selected parameters (collective)."""
    worst = 0.0
    for p in model.parameters():
        if not select(p):
            continue
        local = (p.to_local() if isinstance(p, DTensor) else p).detach().contiguous()
        copies = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, local)
        worst = max(worst, max((c - copies[0]).abs().max().item() for c in copies))
    return worst


class _Differences(Callback):
    def __init__(self, select: Callable[[torch.Tensor], bool]) -> None:
        self.select = select
        self.at_start = self.at_end = -1.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_start = _cross_rank_difference(pl_module, self.select)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.at_end = _cross_rank_difference(pl_module, self.select)


def _unseeded_init_difference(model: torch.nn.Module) -> float:
    """The same model initialized with a different seed per rank (what an unseeded run gets), before any Trainer."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.manual_seed(1000 + rank)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return float(sum(p.detach().abs().sum() for p in model.parameters()))  # differs across ranks


def _run(
    devices: int, strategy: Any, steps: int, unseeded: bool, select: Callable, buffer: bool = False
) -> dict[str, Any]:
    tp = isinstance(strategy, TensorParallelStrategy)
    model, data = make_model_and_data(devices, dp_size=1 if tp else None, vocab_size=64)
    if buffer:
        model.register_buffer("scale", torch.rand(4))
    checksum = _unseeded_init_difference(model) if unseeded else 0.0
    differences = _Differences(select)
    decisions: list[str] = []
    log_decision = strategy.log_decision
    strategy.log_decision = lambda message: (decisions.append(message), log_decision(message))  # what rank 0 logs
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="32-true"), max_steps=steps, callbacks=[differences]
    )
    trainer.fit(model, data)
    checksums = [None] * dist.get_world_size()
    dist.all_gather_object(checksums, checksum)
    equalized = [line for line in decisions if "made equal across" in line]
    return {
        "init_checksums": checksums,
        "at_start": differences.at_start,
        "at_end": differences.at_end,
        "equalized": equalized,
    }


def tp_unseeded(devices: int, workdir: str) -> dict[str, Any]:
    return _run(devices, TensorParallelStrategy(tensor_parallel_size=devices), 4, True, _whole_on_every_rank)


def tp_100_steps(devices: int, workdir: str) -> dict[str, Any]:
    return _run(devices, TensorParallelStrategy(tensor_parallel_size=devices), 100, False, _whole_on_every_rank)


def hsdp_unseeded(devices: int, workdir: str) -> dict[str, Any]:
    strategy = FSDP2Strategy(sharding="hybrid", data_parallel_replicate_size=devices)  # one rank per replica group
    return _run(devices, strategy, 4, True, lambda p: True)


def fsdp2_buffer_unseeded(devices: int, workdir: str) -> dict[str, Any]:
    """FSDP2 shards every parameter; a buffer (as HF models keep RoPE frequencies) stays whole on every dp_shard rank."""
    return _run(devices, FSDP2Strategy(), 2, True, _whole_on_every_rank, buffer=True)


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "fsdp2_buffer_unseeded": fsdp2_buffer_unseeded,
    "tp_unseeded": tp_unseeded,
    "tp_100_steps": tp_100_steps,
    "hsdp_unseeded": hsdp_unseeded,
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
