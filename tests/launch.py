"""Running a scenario script in real processes and reading back its JSON result: the tests' front to the benchmarks'
shared launcher (:mod:`benchmarks.common.launch`, :mod:`benchmarks.common.scenarios`)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.common import scenarios as _scenarios
from benchmarks.common.launch import LAUNCHER_VARIABLES, run_command, run_torchrun_nodes

SCENARIO_DIR = Path(__file__).parent / "scenarios"
REPO_ROOT = Path(__file__).resolve().parents[1]
# LIGHTNING_DIST_FULL_MATRIX=1 runs every mesh and mode; by default the suite leaves out the runs whose code paths other
# scenarios already run, to stay within its 25 minutes on 2 cores (each file lists what it leaves out; docs/testing.md)
FULL_MATRIX = os.environ.get("LIGHTNING_DIST_FULL_MATRIX") == "1"


def run_scenarios(
    script: str,
    devices: int,
    workdir: Path,
    scenarios: list[str],
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``tests/scenarios/<script>`` with ``devices`` processes, each forked from the fork server with the variables
    Lightning's launcher would give it (``LIGHTNING_DIST_FORK_LAUNCH=0``: rank 0 as a new Python, whose Lightning
    launcher starts the others; docs/testing.md).

    Returns rank 0's JSON result; fails with the processes' output when the run fails. ``env`` adds variables.
    """
    return _scenarios.run_scenarios(SCENARIO_DIR / script, devices, workdir, scenarios, timeout, env)


def run_failing_scenario(
    script: str, devices: int, workdir: Path, scenario: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run a scenario that is meant to die (fault injection); returns the finished process, whatever its status."""
    _, cmd, env = _scenarios.scenario_command(SCENARIO_DIR / script, devices, workdir, [scenario])
    return run_command(cmd, cwd=workdir, env=env, timeout=timeout)


def run_on_loopback_nodes(
    script: str,
    nnodes: int,
    nproc_per_node: int,
    workdir: Path,
    scenarios: list[str],
    timeout: float = 600,
    torchrun_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run ``tests/scenarios/<script>`` as ``nnodes`` torchrun launches of ``nproc_per_node`` ranks each, which meet by
    c10d rendezvous on 127.0.0.1 (as separate machines would, minus the network). ``--devices`` is the world size;
    ``torchrun_args`` adds options (``--max-restarts=1``).

    Returns global rank 0's JSON result; fails with every launch's output when one fails.
    """
    world = nnodes * nproc_per_node
    out, cmd, env = _scenarios.scenario_command(SCENARIO_DIR / script, world, workdir, scenarios)
    launches = run_torchrun_nodes(cmd[1:], nnodes, nproc_per_node, out.stem, workdir, env, timeout, torchrun_args)
    if any(status != 0 for status, _ in launches) or not out.exists():
        logs = "\n".join(
            f"--- node launch {i} exited with {status} ---\n{output[-6000:]}"
            for i, (status, output) in enumerate(launches)
        )
        raise AssertionError(logs)
    return json.loads(out.read_text())


def run_training_command(cmd: list[str], root_dir: Path, max_steps: int, timeout: float = 300) -> str:
    """Run a training command (a script, or the console script) from the repository root as a user would; fail
    with its output unless it exits cleanly after ``max_steps``. Returns the output."""
    if "fit" in cmd:  # LightningCLI writes its config.yaml into the root dir: keep it out of the repo
        cmd = [*cmd, f"--trainer.default_root_dir={root_dir}"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}  # see LAUNCHER_VARIABLES
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = run_command(cmd, cwd=REPO_ROOT, env=env, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{output[-8000:]}"
    assert f"`Trainer.fit` stopped: `max_steps={max_steps}` reached." in output, output[-4000:]
    return output


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and len(a) > 0, f"different or empty trajectories: {len(a)} vs {len(b)}"
    return max(abs(x - y) for x, y in zip(a, b))
