"""What fault tolerance costs per step without a failure: 2 replica groups of 2 processes under ``fault_tolerance``
against HSDP (2 replicas × 2 shards) on the same 4 processes, timed in one run on CPU (gloo), one after the other.

    python -m benchmarks.fault_tolerance_overhead                    # d_model 256, 4 layers, 12 steps
    python -m benchmarks.fault_tolerance_overhead --d-model 512 --steps 20

Three runs of the same model, batch and steps: HSDP (the baseline), the groups averaging each FSDP2 unit's gradients
across groups during the backward (FSDP2's all-reduce hook: what ``fault_tolerance`` does under FSDP2), and the
groups averaging them after the backward in one flat buffer per dtype (what it did before, and still does on meshes
without FSDP2). Printed: the median step time of each (the first 3 steps left out) and the ratios to HSDP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scenarios" / "fault_tolerance_runs.py"
WARMUP = 3


def _median_step(seconds: list[float]) -> float:
    return statistics.median(seconds[WARMUP:])


def measure(d_model: int = 256, n_layer: int = 4, steps: int = 12) -> dict[str, Any]:
    """Median step seconds of HSDP and of the two ways of averaging across groups, and their ratios to HSDP."""
    from benchmarks.common.replica_groups import run_replica_groups
    from benchmarks.common.scenarios import run_scenarios

    model = {"d_model": d_model, "n_layer": n_layer, "n_head": 4}
    env = {"FT_TIMED_MODEL": json.dumps(model), "FT_TIMED_STEPS": str(steps)}
    with tempfile.TemporaryDirectory(prefix="ld_ft_overhead_") as tmp:
        work = Path(tmp)
        (work / "hsdp").mkdir()
        hsdp = run_scenarios(SCRIPT, 4, work / "hsdp", ["timed_hsdp"], timeout=1200, env=env)["timed_hsdp"]
        during = run_replica_groups(SCRIPT, 2, work / "during", "timed_groups", env=env, timeout=1200).results
        after_env = {**env, "FT_AFTER_BACKWARD": "1"}
        after = run_replica_groups(SCRIPT, 2, work / "after", "timed_groups", env=after_env, timeout=1200).results
    assert all(g["reduced_in_backward"] for g in during) and not any(g["reduced_in_backward"] for g in after)
    baseline = _median_step(hsdp["seconds"])
    during_s = max(_median_step(g["seconds"]) for g in during)  # the slower group sets the pace
    after_s = max(_median_step(g["seconds"]) for g in after)
    return {
        "model": model,
        "steps": steps,
        "hsdp_s": round(baseline, 4),
        "during_backward_s": round(during_s, 4),
        "after_backward_s": round(after_s, 4),
        "during_ratio": round(during_s / baseline, 3),
        "after_ratio": round(after_s / baseline, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    r = measure(args.d_model, args.layers, args.steps)
    print(f"| {r['model']}, {r['steps']} steps, median step (first {WARMUP} left out) | seconds | / HSDP |")
    print("|---|---|---|")
    print(f"| HSDP, 2 replicas × 2 shards, 4 processes | {r['hsdp_s']:.4f} | 1.00 |")
    print(
        f"| 2 groups × 2, averaged during backward (FSDP2 hook) | {r['during_backward_s']:.4f} | {r['during_ratio']:.2f} |"
    )
    print(
        f"| 2 groups × 2, averaged after backward (flat buffer) | {r['after_backward_s']:.4f} | {r['after_ratio']:.2f} |"
    )
    return 0
