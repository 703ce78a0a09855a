"""What each rank of a launch sees: its launcher variables, its process, its random state, its threads. The
``fails_on_rank_one`` scenario raises on rank 1 while rank 0 waits for it in a collective.

python tests/scenarios/launch_probe.py --devices N --out result.json --scenarios seen|fails_on_rank_one
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import run_scenario_script  # type: ignore[import-not-found]

VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS", "PROBE")


def _joined() -> None:
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["NODE_RANK"]) * int(os.environ["WORLD_SIZE"]) + int(os.environ["LOCAL_RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))


def seen(devices: int, workdir: str) -> list[dict[str, Any]]:
    _joined()
    mine = {
        "variables": {k: os.environ.get(k) for k in VARIABLES},
        "pid": os.getpid(),
        "random": random.random(),
        "threads": torch.get_num_threads(),
        "argv": sys.argv[1:3],
        "cwd": os.getcwd(),
        "script_dir": sys.path[0],
        "main": Path(sys.modules["__main__"].__file__ or "").name,
    }
    everyone: list[Any] = [None] * devices
    if devices > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    return everyone


def fails_on_rank_one(devices: int, workdir: str) -> None:
    _joined()
    if dist.get_rank() == 1:
        raise ValueError("rank one fails on purpose")
    dist.barrier()  # waits for a rank that is gone: the launch must end it


if __name__ == "__main__":
    run_scenario_script({"seen": seen, "fails_on_rank_one": fails_on_rank_one})
