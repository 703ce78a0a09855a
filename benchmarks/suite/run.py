"""Run the benchmark suite and write ``results.json``, ``report.md`` and ``scaling.png``.

Usage (from the repository root)::

    python -m benchmarks.run --quick                 # a few minutes on 2 CPU cores
    python -m benchmarks.run                         # full: every size timed, 5 repeats (about 20-30 min on 2 cores)
    python -m benchmarks.run --out DIR --world-sizes 1,2,4 --workloads fsdp2,mp_fsdp
    python -m benchmarks.run --report-only DIR/results.json   # rebuild the report from saved results
    python -m benchmarks.run --gpu                   # one-GPU throughput comparison (CUDA only; see benchmarks.gpu)

One launch per world size runs every configuration of that world size in the same processes (a torchrun-style
launch, so Lightning's Trainers and the raw PyTorch loop share them): first one measured step per (workload, size)
with the comm counter and memory accounting, then the timed runs, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import lightning
import torch

from benchmarks.common.hardware import compute_dtype, lookup_peak
from benchmarks.common.measure import interleaved_order
from benchmarks.common.models import SIZES
from benchmarks.suite.docs_section import update_performance_doc
from benchmarks.suite.launch import launch
from benchmarks.suite.report import write_report
from benchmarks.suite.workloads import TIME_COMPARISONS, WORKLOADS, availability, layout_for, timed_workloads

MODES: dict[str, dict[str, Any]] = {
    "quick": {"sizes": ["tiny", "small", "medium"], "timing_sizes": ["small"], "repeats": 5, "warmup": 2, "steps": 4},
    "full": {
        "sizes": ["tiny", "small", "medium"],
        "timing_sizes": ["tiny", "small", "medium"],
        "repeats": 5,
        "warmup": 2,
        "steps": 5,
    },
}


def choose_device(accelerator: str, world_sizes: list[int]) -> str:
    """``"cuda"`` or ``"cpu"``; refuses (before anything starts) a CUDA run with more ranks than visible GPUs."""
    if accelerator not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"--accelerator {accelerator!r}: choose auto, cpu or cuda.")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if accelerator == "cuda" or (accelerator == "auto" and gpus > 0) else "cpu"
    if device == "cuda" and max(world_sizes) > gpus:
        raise SystemExit(
            f"--world-sizes {','.join(map(str, world_sizes))}: a CUDA run needs one GPU per rank, and {gpus} GPU(s)"
            f" are visible. Use --world-sizes up to {gpus}, or --accelerator cpu for the CPU (gloo) benchmark."
        )
    return device


def build_plan(config: dict[str, Any], ws: int, available: list[str], device: str = "cpu") -> dict[str, Any]:
    """Every item one launch of world size ``ws`` runs: measurements first, then interleaved timing repeats."""
    items: list[dict[str, Any]] = [
        {"mode": "measure", "workload": name, "size": size, "warmup": 1, "steps": 1}
        for size in config["sizes"]
        for name in available
    ]
    timed = [n for n in timed_workloads(config["comparisons"]) if n in available]
    for size in config["timing_sizes"]:
        for repeat in range(config["repeats"]):
            items += [
                {
                    "mode": "time",
                    "workload": name,
                    "size": size,
                    "warmup": config["warmup"],
                    "steps": config["steps"],
                    "repeat": repeat,
                }
                for name in interleaved_order(timed, repeat)
            ]
    layout = layout_for(ws, device)
    return {
        "device": device,
        "layout": layout.to_dict(),
        "items": items,
        "batch_size": config["batch_size"],
        "precision": config["precision"],
        "timeout": 300,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer timed sizes, repeats and steps (a few minutes)")
    p.add_argument(
        "--out", default="benchmarks/results/suite", help="output folder (default: benchmarks/results/suite)"
    )
    p.add_argument("--world-sizes", default="1,2,4", help="comma-separated world sizes (default 1,2,4)")
    p.add_argument("--sizes", default=None, help=f"comma-separated model sizes out of {list(SIZES)}")
    p.add_argument("--workloads", default=None, help=f"comma-separated subset of {[w.name for w in WORKLOADS]}")
    p.add_argument("--repeats", type=int, default=None, help="interleaved timing repeats")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per timed run")
    p.add_argument("--steps", type=int, default=None, help="timed steps per timed run")
    p.add_argument("--batch-size", type=int, default=4, help="samples per rank per step (default 4)")
    p.add_argument("--precision", default="32-true", help="Lightning precision flag (default 32-true)")
    p.add_argument("--threads", type=int, default=1, help="OMP/torch threads per rank (default 1)")
    p.add_argument(
        "--accelerator", default="auto", help="auto (CUDA when a GPU is visible), cpu or cuda (one GPU per rank)"
    )
    p.add_argument("--update-docs", action="store_true", help="also put the measured tables into docs/performance.md")
    p.add_argument("--report-only", metavar="RESULTS_JSON", help="only rebuild the report from saved results")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="run the one-GPU throughput comparison instead (benchmarks/gpu/throughput.py: fsdp2 with and without compile,"
        " Lightning auto with and without torch.compile, ModelParallelStrategy); needs CUDA. Its own options:"
        " python -m benchmarks.gpu --help",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if "--gpu" in given:  # its own options (sizes, setups, steps) are parsed by benchmarks.gpu
        from benchmarks.gpu import throughput

        return throughput.main(given)
    args = parse_args(argv)
    if args.report_only:
        path = Path(args.report_only)
        results = json.loads(path.read_text())
        paths = write_report(results, path.parent)
        print("\n".join(f"{k}: {v}" for k, v in paths.items()))
        _maybe_update_docs(args, results)
        return 0
    config = dict(MODES["quick" if args.quick else "full"])
    if args.sizes:
        config["sizes"] = config["timing_sizes"] = args.sizes.split(",")
    unknown = [s for s in config["sizes"] if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown model size(s) {unknown}; choose from {list(SIZES)}")
    for key in ("repeats", "warmup", "steps"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    config.update(
        threads_per_rank=args.threads,
        batch_size=args.batch_size,
        precision=args.precision,
        param_bytes=_param_bytes(args.precision),
        comparisons=TIME_COMPARISONS,
    )
    selected = [w for w in WORKLOADS if not args.workloads or w.name in args.workloads.split(",")]
    workloads = {
        w.name: {"description": w.description, "family": w.family, "reason": availability(w)} for w in selected
    }
    for info in workloads.values():
        info["available"] = info["reason"] is None
    available = [n for n, info in workloads.items() if info["available"]]
    for name, info in workloads.items():
        if not info["available"]:
            print(f"benchmarks: {name}: {info['reason']}")
    config["comparisons"] = [list(p) for p in TIME_COMPARISONS if all(n in workloads for n in p)]
    world_sizes = [int(x) for x in args.world_sizes.split(",")]
    device = choose_device(args.accelerator, world_sizes)
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    out = Path(args.out)
    started = datetime.now(timezone.utc)
    results: dict[str, Any] = {
        "meta": {
            "command": "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            "started": started.strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "device": device,
            "device_name": device_name,
            "cpu_count": os.cpu_count(),
            "load_average_at_start": _load_average(),
            "peak_flops": lookup_peak(device_name, compute_dtype(args.precision)) if device == "cuda" else None,
        },
        "config": config,
        "sizes": {
            s: {
                **SIZES[s].gpt_kwargs(),
                "num_parameters": SIZES[s].num_parameters,
                "block_parameters": SIZES[s].num_parameters - _root_parameters(s),
            }
            for s in config["sizes"]
        },
        "world_sizes": world_sizes,
        "layouts": {str(ws): layout_for(ws, device).to_dict() for ws in world_sizes},
        "workloads": workloads,
        "comparisons": config["comparisons"],
        "launch_errors": {},
        "runs": [],
    }
    t0 = time.monotonic()
    for ws in world_sizes:
        plan = build_plan(config, ws, available, device)
        print(f"benchmarks: world size {ws}: {len(plan['items'])} runs ...", flush=True)
        t = time.monotonic()
        res, err = launch(plan, out / "work", timeout=120 + 60 * len(plan["items"]), threads=args.threads)
        print(f"benchmarks: world size {ws} done in {time.monotonic() - t:.0f} s" + (f" ({err})" if err else ""))
        if err:
            results["launch_errors"][str(ws)] = err
        results["runs"] += (res or {}).get("results", [])
    results["meta"]["elapsed_s"] = time.monotonic() - t0
    results["meta"]["load_average_at_end"] = _load_average()
    out.mkdir(parents=True, exist_ok=True)
    paths = write_report(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(f"{k}: {v}" for k, v in {**paths, "results": out / "results.json"}.items()))
    _maybe_update_docs(args, results)
    return 1 if results["launch_errors"] else 0


def _maybe_update_docs(args: argparse.Namespace, results: dict[str, Any]) -> None:
    if args.update_docs:
        doc = Path(__file__).resolve().parents[2] / "docs" / "performance.md"
        ok = update_performance_doc(results, doc)
        print(f"docs/performance.md: {'updated' if ok else 'no benchmarks:start/end markers, not changed'}")


def _load_average() -> float | None:
    """The host's 1-minute load average (other processes competing for the cores make time ratios noisy)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _param_bytes(precision: str) -> int:
    """Bytes per parameter at rest: fp64 for ``64-true``, 16-bit for ``bf16-true``/``16-true``, else fp32."""
    if precision.startswith("64"):
        return 8
    if precision in ("bf16-true", "16-true", "bf16", "16"):
        return 2
    return 4


def _root_parameters(size: str) -> int:
    """Parameters outside the transformer blocks (embeddings, final norm, head): the FSDP root's share."""
    s = SIZES[size]
    return s.vocab_size * s.d_model + s.seq_len * s.d_model + 2 * s.d_model + s.d_model * s.vocab_size


if __name__ == "__main__":
    sys.exit(main())
