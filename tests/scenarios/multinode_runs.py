"""fsdp2, tensor_parallel_2d and zeropp on 4 ranks: as 2 nodes × 2 under two torchrun launches with c10d rendezvous on
loopback, or as one node of 4 processes (zeropp then declares ``ranks_per_node=2``, the simulated layout).

    python tests/scenarios/multinode_runs.py --devices 4 --out r.json --scenarios fsdp2,tp2d,zeropp
    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT \
        tests/scenarios/multinode_runs.py --devices 4 --out r.json --scenarios fsdp2,tp2d,zeropp

``--devices`` is the world size either way; under torchrun the ranks per node come from the environment
(``LOCAL_WORLD_SIZE``) and no strategy is told how many there are.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import lightning as L
import torch
from common import (  # type: ignore[import-not-found]
    RANKS_PER_NODE,
    ZEROPP_MODEL,
    StepBytes,
    StepRecorder,
    full_state,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)

from lightning_dist import FSDP2Strategy, TensorParallelStrategy, ZeroPPStrategy

STEPS = 3
UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ


def _layout(world: int) -> dict[str, int]:
    per_node = int(os.environ["LOCAL_WORLD_SIZE"]) if UNDER_TORCHRUN else world
    return {"devices": per_node, "num_nodes": world // per_node}


def _fit(world: int, strategy: Any, precision: str, model_kwargs: dict, dp: int, callbacks: list) -> dict[str, Any]:
    model, data = make_model_and_data(world, dp_size=dp, **model_kwargs)
    recorder = StepRecorder()
    trainer = L.Trainer(
        **{**trainer_kwargs(world, strategy=strategy), **_layout(world)},
        precision=precision,
        max_steps=STEPS,
        callbacks=[recorder, *callbacks],
    )
    trainer.fit(model, data)
    state = full_state(model)
    digest = hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in state.values()))
    return {
        "losses": recorder.losses,
        "params": digest.hexdigest(),
        "node_rank": trainer.strategy.node_rank,
        "num_nodes": trainer.num_nodes,
    }


def fsdp2(world: int, workdir: str) -> dict[str, Any]:
    return _fit(world, FSDP2Strategy(), "64-true", {}, dp=world, callbacks=[])


def tp2d(world: int, workdir: str) -> dict[str, Any]:
    strategy = TensorParallelStrategy(tensor_parallel_size=2, data_parallel_shard_size="auto")
    return _fit(world, strategy, "64-true", {"vocab_size": 64}, dp=world // 2, callbacks=[])


def zeropp(world: int, workdir: str) -> dict[str, Any]:
    counting = StepBytes()
    strategy = ZeroPPStrategy() if UNDER_TORCHRUN else ZeroPPStrategy(ranks_per_node=RANKS_PER_NODE)
    result = _fit(world, strategy, "bf16-mixed", ZEROPP_MODEL, dp=world, callbacks=[counting])
    return {**result, "bytes": counting.table(), "hpz": strategy._hpz}


SCENARIOS = {"fsdp2": fsdp2, "tp2d": tp2d, "zeropp": zeropp}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
