"""Scripts run by the scenario convention: ``SCRIPT --devices N --out JSON --workdir DIR --scenarios a,b``, each rank
running every named scenario, rank 0 writing one JSON object for them. The ranks are forked from
:mod:`benchmarks.common.fork_server` (or, with ``LIGHTNING_DIST_FORK_LAUNCH=0``, rank 0 is started as a new Python and
Lightning's launcher starts the others). The tests' multi-process scripts (``tests/scenarios/``, through
``tests/launch.py``) and :mod:`benchmarks.studies.float8_parity` use it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.launch import child_env, free_port, run_command


def scenario_command(
    script: Path, devices: int, workdir: Path, scenarios: list[str], extra_env: dict[str, str] | None = None
) -> tuple[Path, list[str], dict[str, str]]:
    """Where the result will be, the command, and its environment (``extra_env`` added)."""
    out = workdir / f"{Path(script).stem}_d{devices}_{abs(hash(tuple(scenarios))) % 10**8}.json"
    cmd = [
        sys.executable,
        str(script),
        "--devices",
        str(devices),
        "--out",
        str(out),
        "--workdir",
        str(workdir),
        "--scenarios",
        ",".join(scenarios),
    ]
    return out, cmd, child_env(extra_env)


def run_scenarios(
    script: Path,
    devices: int,
    workdir: Path,
    scenarios: list[str],
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``script`` with ``devices`` processes. Returns rank 0's JSON result; fails (``AssertionError``) with the
    processes' output when the run fails. ``env`` adds variables."""
    out, cmd, env = scenario_command(script, devices, workdir, scenarios, env)
    if fork_launch_enabled() and not starts_its_own_processes(script):
        _run_forked(cmd[1:], devices, workdir, env, timeout)
        return json.loads(out.read_text())
    proc = run_command(cmd, cwd=workdir, env=env, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(
            f"{' '.join(cmd)} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
            f"\n--- stderr ---\n{proc.stderr[-10000:]}"
        )
    return json.loads(out.read_text())


def starts_its_own_processes(script: Path) -> bool:
    """Whether ``script`` starts its ranks itself (the pure-PyTorch harness, ``tests/scenarios/pure_torch.py``, spawns
    them without Lightning): it runs once, as a new Python, whatever ``--devices`` says."""
    return "from pure_torch import" in Path(script).read_text()


def fork_launch_enabled() -> bool:
    """Whether scenario ranks are forked from the fork server (:mod:`benchmarks.common.fork_server`): unless
    ``LIGHTNING_DIST_FORK_LAUNCH=0``."""
    return os.environ.get("LIGHTNING_DIST_FORK_LAUNCH", "1") != "0"


def _run_forked(argv: list[str], devices: int, workdir: Path, env: dict[str, str], timeout: float) -> None:
    """Every rank forked from the fork server, with the variables Lightning's launcher gives the ranks it starts;
    fails with the output of the ranks that failed (the others are killed) or of every rank after ``timeout``."""
    if devices > 1:
        launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NODE_RANK": "0"}
        launcher["WORLD_SIZE"] = str(devices)
        # one rank per core at most, as torchrun does and Lightning sets in the rank it runs (spinning OpenMP threads
        # of four ranks on two cores cost more than the import this saves)
        launcher["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // devices)))
        envs = [{**env, **launcher, "LOCAL_RANK": str(rank)} for rank in range(devices)]
    else:
        envs = [env]
    out = Path(argv[argv.index("--out") + 1])
    logs = [workdir / f"{out.stem}.rank{rank}.log" for rank in range(len(envs))]
    from benchmarks.common import fork_server  # not imported by `python -m benchmarks.common.fork_server` itself

    procs = [fork_server.start(argv, rank_env, workdir, log) for rank_env, log in zip(envs, logs)]
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
        statuses = [p.wait() for p in procs]
    if any(statuses) or not out.exists():
        timed_out = "" if time.monotonic() <= deadline else f" (stopped after {timeout:.0f} s)"
        shown = [
            r for r, status in enumerate(statuses) if status not in (0, -signal.SIGKILL)
        ]  # not the ones killed here or list(range(len(statuses)))
        output = "".join(f"\n--- rank {r} (status {statuses[r]}) ---\n{logs[r].read_text(errors='replace')[-8000:]}"
                         for r in shown)  # fmt: skip
        raise AssertionError(f"{' '.join(argv)} on {devices} forked ranks failed{timed_out}{output}")
