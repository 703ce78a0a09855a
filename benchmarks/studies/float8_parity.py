"""FP8 parity matrix (issue 29): each model × strategy cell trained with ``float8="rowwise"`` (torchao, emulated on
the CPU, fp32 master weights) and without float8, same seed, initial weights and data, 6 AdamW steps.

Per cell: the max |loss difference| over the 6 steps against the cell's own run without float8, the converted
layers (gathered from every rank: pipeline stages hold different blocks) and whether each is a torchao
``Float8Linear``, and the skipped layers with their reasons (the strategy's log line). Writes
``benchmarks/results/studies/float8_parity.json`` and the table in ``docs/float8.md`` between the ``float8-parity`` markers.

The tests (tests/test_float8.py) cover the GPT under fsdp2 / tensor_parallel / context_parallel / hybrid3d and the
Llama under fsdp2; this adds the GPT under pipeline and the Llama under tensor_parallel, pipeline and hybrid3d
(4 processes), and reruns the covered cells against their own strategy for a complete table.

    python -m benchmarks.float8_parity [--cells gpt/pipeline,llama/tensor_parallel ...]

Tolerances: the example GPT 1e-2 (issue 29's expectation for 6 steps); the stock transformers Llama 5e-2: it trains
at lr 1e-2 from the first step (no warm-up) and its GQA key/value projections are 32×16, the narrowest FP8 accepts,
so its FP8 and fp32 runs part faster (5e-4 after step 1, 2.8e-2 by step 6 under fsdp2, see tests/test_float8.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "studies" / "float8_parity.json"
DOC = ROOT / "docs" / "float8.md"
START, END = "<!-- float8-parity:start -->", "<!-- float8-parity:end -->"
TOLERANCE = {"gpt": 1e-2, "llama": 5e-2}
SENSITIVITY = "llama/sensitivity"  # one process: fp32 vs bf16-mixed vs FP8, with and without warm-up
# (model, strategy) -> processes; "covered" = also in the suite (tests/test_float8.py).
CELLS: dict[str, dict[str, Any]] = {
    "gpt/fsdp2": {"devices": 2, "covered": True},
    "gpt/tensor_parallel": {"devices": 2, "covered": True},
    "gpt/pipeline": {"devices": 2, "covered": False},
    "llama/fsdp2": {"devices": 2, "covered": True},
    "llama/tensor_parallel": {"devices": 2, "covered": False},
    "llama/pipeline": {"devices": 2, "covered": False},
    "gpt/hybrid3d": {"devices": 4, "covered": True},
    "llama/hybrid3d": {"devices": 4, "covered": False},
}


# ------------------------------------------------------------------------------------------ worker (in each rank)
def _strategy(name: str, devices: int, **float8: Any) -> tuple[Any, int]:
    """The strategy of a cell and its data-parallel size."""
    from lightning_dist import FSDP2Strategy, Hybrid3DStrategy, PipelineStrategy, TensorParallelStrategy

    if name == "fsdp2":
        return FSDP2Strategy(**float8), devices
    if name == "tensor_parallel":
        return TensorParallelStrategy(tensor_parallel_size=devices, **float8), 1
    if name == "pipeline":
        return PipelineStrategy(pipeline_parallel_size=devices, **float8), 1
    if name == "hybrid3d":
        return Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, **float8), devices // 4
    raise ValueError(f"unknown strategy {name!r}")


def _every_rank(value: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _cell(cell: str, devices: int) -> dict[str, Any]:
    from float8_runs import _fit  # type: ignore[import-not-found]

    from lightning_dist.compat.torchao import is_float8_linear

    model_name, strategy_name = cell.split("/")
    runs = {}
    for label, float8 in (("plain", {}), ("float8", {"float8": "rowwise"})):
        strategy, dp = _strategy(strategy_name, devices, **float8)
        t0 = time.perf_counter()
        model, result = _fit(devices, strategy, dp=dp, llama=model_name == "llama")
        # Every rank's converted layers, checked by type on the rank that holds them.
        mine = {n: is_float8_linear(model.get_submodule(n)) for n in result["converted"]}
        ranks = _every_rank({"converted": mine, "plain": result["plain"], "log": result["log"]})
        result["converted_per_rank"] = [sorted(r["converted"]) for r in ranks]
        result["converted"] = sorted({n for r in ranks for n in r["converted"]})
        result["all_float8_linear"] = all(ok for r in ranks for ok in r["converted"].values())
        result["plain"] = sorted({n for r in ranks for n in r["plain"]})
        result["log"] = next((r["log"] for r in ranks if r["log"]), [])
        result["seconds"] = time.perf_counter() - t0
        runs[label] = result
    return runs


def _sensitivity(devices: int) -> dict[str, list[float]]:
    """Why the Llama needs its own bound: the Llama in one process in fp32, bf16-mixed (no float8) and rowwise FP8,
    at lr 1e-2 from the first step (as in the cells) and with the example GPT's 2-step linear warm-up."""
    import float8_runs  # type: ignore[import-not-found]
    import torch
    from models import HFLlama  # type: ignore[import-not-found]

    from lightning_dist import FSDP2Strategy

    class WarmedUpLlama(HFLlama):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    out = {}
    for schedule, cls in (("no_warmup", HFLlama), ("warmup_2", WarmedUpLlama)):
        float8_runs.HFLlama = cls  # _fit builds float8_runs.HFLlama(64) when llama=True
        try:
            for run, options, precision in (("fp32", {}, "32-true"), ("bf16-mixed", {}, "bf16-mixed"),
                                            ("float8", {"float8": "rowwise"}, "32-true")):  # fmt: skip
                _, result = float8_runs._fit(devices, FSDP2Strategy(**options), dp=devices, llama=True,
                                             precision=precision)  # fmt: skip
                out[f"{schedule}/{run}"] = result["losses"]
        finally:
            float8_runs.HFLlama = HFLlama
    return out


def _worker() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "scenarios"))
    from common import parse_args, write_result  # type: ignore[import-not-found]

    args = parse_args()
    cells = args.scenarios.split(",")
    write_result(args.out, {c: _sensitivity(args.devices) if c == SENSITIVITY else _cell(c, args.devices)
                            for c in cells})  # fmt: skip


# ---------------------------------------------------------------------------------------------- driver
def _skipped(log: list[str]) -> dict[str, str]:
    """``{layer: reason}`` from the strategy's line ``...; skipped: a (why); b (why)``."""
    if not log or "skipped: " not in log[0]:
        return {}
    tail = log[0].split("skipped: ", 1)[1]
    return {} if tail == "none" else dict(re.findall(r"([^;()\s]+) \(([^)]*)\)", tail))


def summarize(cell: str, runs: dict[str, Any]) -> dict[str, Any]:
    plain, fp8 = runs["plain"], runs["float8"]
    model = cell.split("/")[0]
    diffs = [abs(a - b) for a, b in zip(plain["losses"], fp8["losses"])]
    logged = re.search(r"converted (\d+) nn.Linear", fp8["log"][0]) if fp8["log"] else None
    skipped = _skipped(fp8["log"])
    return {
        "cell": cell,
        "processes": CELLS[cell]["devices"],
        "in_suite": CELLS[cell]["covered"],
        "steps": len(diffs),
        "max_abs_loss_diff": max(diffs),
        "loss_diff_per_step": diffs,
        "tolerance": TOLERANCE[model],
        "within_tolerance": len(diffs) == 6 and 0 < max(diffs) <= TOLERANCE[model],
        "converted": len(fp8["converted"]),
        "converted_logged": int(logged.group(1)) if logged else None,
        "all_converted_are_float8_linear": fp8["all_float8_linear"] and bool(fp8["converted"]),
        "reference_converted_nothing": plain["converted"] == [],
        "unconverted_linears": fp8["plain"],
        "skipped": skipped,
        "every_unconverted_named": set(fp8["plain"]) == set(skipped),
        "weight_dtypes": fp8["weight_dtypes"],
        "losses_plain": plain["losses"],
        "losses_float8": fp8["losses"],
        "log": fp8["log"],
        "seconds": plain["seconds"] + fp8["seconds"],
    }


def summarize_sensitivity(losses: dict[str, list[float]]) -> dict[str, Any]:
    """Per schedule, each run's max |loss difference| to the fp32 run of the same schedule."""
    diffs = {}
    for key, run in losses.items():
        schedule, name = key.split("/")
        if name != "fp32":
            diffs[key] = max(abs(a - b) for a, b in zip(losses[f"{schedule}/fp32"], run))
    return {"losses": losses, "max_abs_loss_diff_vs_fp32": diffs}


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | strategy | processes | max \\|Δloss\\| (6 steps) | tolerance | converted (all Float8Linear) "
        "| skipped (reason) | in the suite |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        model, strategy = r["cell"].split("/")
        ok = "yes" if r["all_converted_are_float8_linear"] else "**no**"
        skipped = "; ".join(f"`{n}` ({why})" for n, why in r["skipped"].items()) or "none"
        mark = "" if r["within_tolerance"] else " **over**"
        lines.append(
            f"| {model} | {strategy} | {r['processes']} | {r['max_abs_loss_diff']:.1e}{mark} | {r['tolerance']:.0e} "
            f"| {r['converted']} ({ok}) | {skipped} | {'yes' if r['in_suite'] else 'no'} |"
        )
    return head + "\n".join(lines) + "\n"


def sensitivity_text(s: dict[str, Any] | None) -> str:
    if not s:
        return ""
    d = s["max_abs_loss_diff_vs_fp32"]
    return (
        "\n\nWhy the Llama has its own bound (one process, same data): at lr 1e-2 from the first step, bf16-mixed "
        f"without float8 also parts from fp32 by {d['no_warmup/bf16-mixed']:.1e} and FP8 by "
        f"{d['no_warmup/float8']:.1e}; with the example GPT's 2-step linear warm-up, bf16-mixed "
        f"{d['warmup_2/bf16-mixed']:.1e} and FP8 {d['warmup_2/float8']:.1e}, inside the GPT's 1e-2. The step-6 gap "
        "is this schedule amplifying any rounding, not FP8 in particular.\n"
    )


def write_doc(rows: list[dict[str, Any]], sensitivity: dict[str, Any] | None = None) -> None:
    text = DOC.read_text()
    intro = (
        "Generated by `python -m benchmarks.float8_parity` (results: `benchmarks/results/studies/float8_parity.json`). "
        'CPU, emulated, fp32 master weights, `float8="rowwise"` against the same strategy without float8 (same '
        "seed, initial weights, data), 6 AdamW steps. Tolerance: example GPT 1e-2 (issue 29); stock transformers "
        "Llama 5e-2 (lr 1e-2 without warm-up, GQA key/value projections 32×16, the narrowest FP8 accepts)."
    )
    why = sensitivity_text(sensitivity)
    why = f"\n{textwrap.fill(why.strip(), 118)}\n" if why else ""
    block = f"{START}\n\n{textwrap.fill(intro, 118)}\n\n{table(rows)}{why}\n{END}"
    if START in text:
        text = text[: text.index(START)] + block + text[text.index(END) + len(END) :]
    else:
        anchor = "## mxfp8"
        text = text.replace(anchor, f"### Parity matrix\n\n{block}\n\n{anchor}", 1)
    DOC.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default=",".join(CELLS), help="comma-separated model/strategy cells")
    parser.add_argument("--no-doc", action="store_true", help="do not rewrite docs/float8.md")
    parser.add_argument("--no-sensitivity", action="store_true", help="skip the one-process Llama warm-up check")
    args = parser.parse_args()
    from benchmarks.common.scenarios import run_scenarios

    chosen = args.cells.split(",")
    previous = json.loads(RESULTS.read_text())["cells"] if RESULTS.exists() else []
    rows = {r["cell"]: r for r in previous}
    for devices in sorted({CELLS[c]["devices"] for c in chosen}):
        group = [c for c in chosen if CELLS[c]["devices"] == devices]
        with tempfile.TemporaryDirectory() as workdir:
            t0 = time.perf_counter()
            runs = run_scenarios(Path(__file__).resolve(), devices, Path(workdir), group, timeout=3600)
            print(f"{devices} processes: {group} in {time.perf_counter() - t0:.0f} s", flush=True)
        for cell in group:
            rows[cell] = summarize(cell, runs[cell])
            r = rows[cell]
            print(f"  {cell}: max|dloss| {r['max_abs_loss_diff']:.2e} (tol {r['tolerance']:.0e}), "
                  f"converted {r['converted']}, skipped {r['skipped']}", flush=True)  # fmt: skip
    sensitivity = json.loads(RESULTS.read_text()).get("llama_sensitivity") if RESULTS.exists() else None
    if not args.no_sensitivity:
        with tempfile.TemporaryDirectory() as workdir:
            losses = run_scenarios(Path(__file__).resolve(), 1, Path(workdir), [SENSITIVITY], timeout=3600)
        sensitivity = summarize_sensitivity(losses[SENSITIVITY])
        for key, diff in sensitivity["max_abs_loss_diff_vs_fp32"].items():
            print(f"  llama one process, {key}: max|dloss| vs fp32 {diff:.2e}", flush=True)
    ordered = [rows[c] for c in CELLS if c in rows]
    result = {"steps": 6, "recipe": "rowwise", "cells": ordered, "llama_sensitivity": sensitivity}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    if not args.no_doc:
        write_doc(ordered, sensitivity)


if __name__ == "__main__":
    if "--devices" in sys.argv:
        _worker()
    else:
        main()
