"""Scripts run by the scenario convention: ``SCRIPT --devices N --out JSON --workdir DIR --scenarios a,b``, started
once (Lightning's launcher starts the other ranks), rank 0 writing one JSON object for the scenarios it ran. The
tests' multi-process scripts (``tests/scenarios/``, through ``tests/launch.py``) and
:mod:`benchmarks.studies.float8_parity` use it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common.launch import child_env, run_command


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
    proc = run_command(cmd, cwd=workdir, env=env, timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(
            f"{' '.join(cmd)} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
            f"\n--- stderr ---\n{proc.stderr[-10000:]}"
        )
    return json.loads(out.read_text())
