"""One launch of the suite: a plan run by :mod:`benchmarks.suite.worker` on every rank (started by the shared
launcher, :mod:`benchmarks.common.launch`), rank 0's results collected."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.launch import ROOT, failed_ranks, start_ranks, stop_processes, wait_ranks
from benchmarks.common.layout import Layout

WORKER = ROOT / "benchmarks" / "suite" / "worker.py"


def launch(
    plan: dict[str, Any], workdir: Path, timeout: float, threads: int = 1
) -> tuple[dict[str, Any] | None, str | None]:
    """Run ``plan`` on ``plan["layout"]`` processes.

    Returns:
        Rank 0's results (possibly partial) and an error message (``None`` when every process exited cleanly).
        On a timeout or a failed rank, the remaining processes of this launch are killed.

    Args:
        plan: The plan (see :func:`benchmarks.suite.run.build_plan`).
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
    logs = [open(workdir / f"log_{tag}_rank{rank}.txt", "w") for rank in range(layout.world_size)]  # noqa: SIM115
    cmd = [sys.executable, str(WORKER), "--plan", str(plan_path), "--out", str(out_path)]
    deadline = time.monotonic() + timeout

    def problem() -> str | None:
        failed = failed_ranks(procs)
        if failed:
            return f"rank(s) {failed} exited with an error; see {workdir}/log_{tag}_rank*.txt"
        if time.monotonic() > deadline:
            return f"timed out after {timeout:.0f} s; see {workdir}/log_{tag}_rank*.txt"
        return None

    procs = start_ranks(cmd, layout, logs, threads)
    try:
        error = wait_ranks(procs, problem)
        failed = failed_ranks(procs)
        if error is None and failed:
            error = f"rank(s) {failed} exited with an error; see {workdir}/log_{tag}_rank*.txt"
    finally:
        stop_processes(procs, logs)
    result = json.loads(out_path.read_text()) if out_path.exists() else None
    return result, error
