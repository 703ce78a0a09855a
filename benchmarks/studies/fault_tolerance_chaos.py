"""``python -m benchmarks.fault_tolerance_chaos``: the chaos run of docs/fault_tolerance.md on CPU.

A torchft lighthouse and 2 replica groups (gloo), each an ordinary Lightning job: fsdp2 groups of 2 processes, then
hybrid3d groups of pp2 × tp2 (4 processes each). Every process of group 1 is killed (SIGKILL) at step 10 and the
group is relaunched 5 s later; 30 steps in all (the example GPT, fp64; steps slowed by a sleep, longer while a group
trains alone, so that the relaunched group, whose start takes 8 to 40 s on 2 busy cores, rejoins before the end).
Printed per mesh: the steps group 0 trained without group 1, its longest step (without the sleep) around the
failure, the time group 1 took from its relaunch to its first committed step, the bytes each of its ranks received
while healing, and whether both groups end with bitwise equal parameters and optimizer states.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scenarios" / "fault_tolerance_runs.py"
MESHES = {"fsdp2": ("", 2), "hybrid3d_pp2_tp2": ("pp2tp2", 4), "zeropp": ("zeropp", 2)}


def bitwise_equal(workdir: Path, ranks: int) -> bool:
    """Whether every rank of group 0 holds exactly what the same rank of group 1 holds (parameters and optimizer
    state), from the files the scenario saved."""
    for rank in range(ranks):
        mine = torch.load(workdir / f"chaos_g0_r{rank}.pt", weights_only=False)
        theirs = torch.load(workdir / f"chaos_g1_r{rank}.pt", weights_only=False)
        if mine["params"].keys() != theirs["params"].keys() or len(mine["optimizer"]) != len(theirs["optimizer"]):
            return False
        if not all(torch.equal(v, theirs["params"][k]) for k, v in mine["params"].items()):
            return False
        for a, b in zip(mine["optimizer"], theirs["optimizer"]):
            if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
                return False
    return True


def figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures from the two groups' results."""
    survivor, relaunched = results
    rows = survivor["rows"]
    own = [r["seconds"] - r["slept"] for r in rows]
    return {
        "steps_without_group_1": sum(1 for r in rows if r["quorum"] == 1),
        "group_0_longest_step_s": round(max(own), 2),
        "group_0_longest_step_at": rows[own.index(max(own))]["global_step"],
        "group_0_steps_committed": survivor["committed"],
        "group_0_steps_skipped": survivor["skipped"],
        "group_1_launch_to_first_commit_s": round(relaunched["first_commit_after_launch"], 2),
        "group_1_healed_at_global_step": relaunched["rows"][0]["global_step"] - 1,
        "group_1_received_bytes_per_rank": relaunched["received_bytes"],
        "final_global_steps": [survivor["global_step"], relaunched["global_step"]],
    }


def run(mesh: str, steps: int, kill_at: int, workdir: Path) -> dict[str, Any]:
    from benchmarks.common.replica_groups import Chaos, run_replica_groups

    variant, devices = MESHES[mesh]
    env = {"CHAOS_STEPS": str(steps), "CHAOS_STEP_SLEEP": "0.3", "CHAOS_ALONE_SLEEP": "4", "CHAOS_MESH": variant}
    result = run_replica_groups(SCRIPT, devices, workdir, "chaos", chaos=Chaos(1, kill_at, 5.0), env=env, timeout=1500)
    out = figures(result.results)
    out["bitwise_equal"] = bitwise_equal(workdir, devices)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="fsdp2,hybrid3d_pp2_tp2", help=f"comma-separated, of {list(MESHES)}")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    report: dict[str, Any] = {}
    for mesh in args.meshes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            report[mesh] = run(mesh, args.steps, args.kill_at, Path(tmp))
        print(mesh, json.dumps(report[mesh], indent=1), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if all(r["bitwise_equal"] for r in report.values()) else 1
