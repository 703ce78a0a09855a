"""The harness of the scenario scripts that exercise the pure-PyTorch layer (``lightning_dist.parallel``) without
Lightning: importing this module makes the package importable without its root (whose strategies import
Lightning), so each process starts seconds faster and the result can show that nothing needed Lightning.

``run_pure_torch_scenarios(SCENARIOS, default_devices)`` parses ``--devices/--out/--scenarios``, spawns the
processes with a gloo group, runs each named scenario on every rank (``scenario(rank, context)``) and writes rank 0's
results, each scenario's seconds, ``lightning_imported`` and ``lightning_imported_by`` (the first scenario after
which it was; litgpt's model imports it) as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if "lightning_dist" not in sys.modules:  # the pure-PyTorch layer, without the package root's Lightning imports
    _package = types.ModuleType("lightning_dist")
    _package.__path__ = [str(ROOT / "lightning_dist")]
    sys.modules["lightning_dist"] = _package

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def world_size(rank: int, world: int) -> int:
    """The default context a scenario gets: the number of processes."""
    return world


def _worker(
    rank: int,
    world: int,
    port: int,
    names: list[str],
    out: str,
    scenarios: dict[str, Callable[[int, Any], Any]],
    context: Callable[[int, int], Any],
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        shared = context(rank, world)
        result: dict[str, Any] = {}
        for name in names:
            start = time.perf_counter()
            result[name] = scenarios[name](rank, shared)
            result[f"{name}_seconds"] = round(time.perf_counter() - start, 2)
            if "lightning_imported_by" not in result and _lightning_imported():
                result["lightning_imported_by"] = name  # the first scenario after which Lightning was imported
        result["lightning_imported"] = _lightning_imported()
        if rank == 0:
            Path(f"{out}.tmp").write_text(json.dumps(result))
            os.replace(f"{out}.tmp", out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _lightning_imported() -> bool:
    return any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in sys.modules)


def run_pure_torch_scenarios(
    scenarios: dict[str, Callable[[int, Any], Any]],
    default_devices: int,
    context: Callable[[int, int], Any] = world_size,
) -> None:
    """The command line of a pure-PyTorch scenario script (see the module docstring). ``context(rank, world)`` runs
    once per process after the group exists; its result is every scenario's second argument."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=default_devices)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default=",".join(scenarios))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    names = list(scenarios) if args.scenarios == "all" else args.scenarios.split(",")
    worker_args = (args.devices, _free_port(), names, args.out, scenarios, context)
    mp.spawn(_worker, args=worker_args, nprocs=args.devices, join=True)
