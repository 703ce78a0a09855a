"""Start one worker process per rank with a torchrun-style environment and collect rank 0's results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.workloads import Layout

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(layout: Layout, rank: int, port: int, threads: int) -> dict[str, str]:
    """Environment of global rank ``rank``, as ``torchrun`` would set it on a node of ``layout.ranks_per_node``."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(layout.world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank % layout.ranks_per_node),
        LOCAL_WORLD_SIZE=str(layout.ranks_per_node),
        GROUP_RANK=str(rank // layout.ranks_per_node),
        TORCHELASTIC_RUN_ID="lightning_dist_benchmarks",
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    return env


def launch(
    plan: dict[str, Any], workdir: Path, timeout: float, threads: int = 1
) -> tuple[dict[str, Any] | None, str | None]:
    """Run ``plan`` on ``plan["layout"]`` processes.

    Returns:
        Rank 0's results (possibly partial) and an error message (``None`` when every process exited cleanly).
        On a timeout or a failed rank, the remaining processes of this launch are killed.

    Args:
        plan: The plan (see :func:`benchmarks.run.build_plan`).
        workdir: Folder for the plan, rank 0's result and one log per rank.
        timeout: Seconds before the launch is killed.
        threads: ``OMP_NUM_THREADS`` of every rank. One thread per rank keeps ranks from spin-waiting on each
            other's cores on a small shared host; give more on a host with cores to spare.
    """
    layout = Layout(plan["layout"]["world_size"], plan["layout"]["num_nodes"])
    tag = f"ws{layout.world_size}"
    workdir.mkdir(parents=True, exist_ok=True)
    plan_path, out_path = workdir / f"plan_{tag}.json", workdir / f"result_{tag}.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    out_path.unlink(missing_ok=True)
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = []
    for rank in range(layout.world_size):
        log = open(workdir / f"log_{tag}_rank{rank}.txt", "w")  # noqa: SIM115  (closed below)
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), "--plan", str(plan_path), "--out", str(out_path)],
                env=rank_env(layout, rank, port, threads),
                cwd=str(ROOT),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    error = None
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                error = f"rank(s) {failed} exited with an error; see {workdir}/log_{tag}_rank*.txt"
                break
            if time.monotonic() > deadline:
                error = f"timed out after {timeout:.0f} s; see {workdir}/log_{tag}_rank*.txt"
                break
            time.sleep(0.5)
        failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if error is None and failed:
            error = f"rank(s) {failed} exited with an error; see {workdir}/log_{tag}_rank*.txt"
    finally:
        stop_processes(procs, logs)
    result = json.loads(out_path.read_text()) if out_path.exists() else None
    return result, error


def stop_processes(procs: list[subprocess.Popen], logs: list[Any]) -> None:
    """Kill the ranks still running (after a failure or a timeout) and close their log files."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
