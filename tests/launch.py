"""Running a scenario script in real processes and reading back its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCENARIO_DIR = Path(__file__).parent / "scenarios"
REPO_ROOT = Path(__file__).resolve().parents[1]


def run_scenarios(
    script: str, devices: int, workdir: Path, scenarios: list[str], timeout: float = 600
) -> dict[str, Any]:
    """Run ``tests/scenarios/<script>`` with ``devices`` processes (Lightning's own launcher starts the extra ranks).

    Returns rank 0's JSON result; fails with the processes' output when the run fails.
    """
    out, cmd, env = _command(script, devices, workdir, scenarios)
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(
            f"{' '.join(cmd)} exited with {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
            f"\n--- stderr ---\n{proc.stderr[-10000:]}"
        )
    return json.loads(out.read_text())


def run_failing_scenario(
    script: str, devices: int, workdir: Path, scenario: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run a scenario that is meant to die (fault injection); returns the finished process, whatever its status."""
    _, cmd, env = _command(script, devices, workdir, [scenario])
    return subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _command(script: str, devices: int, workdir: Path, scenarios: list[str]) -> tuple[Path, list[str], dict]:
    out = workdir / f"{Path(script).stem}_d{devices}_{abs(hash(tuple(scenarios))) % 10**8}.json"
    cmd = [
        sys.executable,
        str(SCENARIO_DIR / script),
        "--devices",
        str(devices),
        "--out",
        str(out),
        "--workdir",
        str(workdir),
        "--scenarios",
        ",".join(scenarios),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)
    return out, cmd, env


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and len(a) > 0, f"different or empty trajectories: {len(a)} vs {len(b)}"
    return max(abs(x - y) for x, y in zip(a, b))
