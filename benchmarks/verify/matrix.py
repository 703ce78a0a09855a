"""The verify matrix: ``lightning_dist.verify`` run on the example GPT and stock third-party models (Llama, tied
GPT-2, BERT, litgpt) under every registered strategy (the compatibility matrix's columns), in fp32 (tolerance 1e-4)
and, on fsdp2, tensor_parallel, pipeline, context_parallel and hybrid3d pp2 × tp2, in fp64 (1e-10).

Usage (from the repository root)::

    python -m benchmarks.verify_matrix                                   # fp32, every model and column
    python -m benchmarks.verify_matrix --dtype float64                   # fp64 on the five columns above
    python -m benchmarks.verify_matrix --models gpt,llama --columns fsdp2,pipeline   # some cells, merged in
    python -m benchmarks.verify_matrix --render                          # the docs table from the recorded results

Each cell is one ``verify(...)`` call (the strategy's run and the one-process reference, each in processes of their
own); the references are kept in one ``reference_cache`` folder per matrix run, so a model's reference trains once
per global batch layout and dtype. A cell's outcome:

- ``passed``: verify reports every compared quantity within its tolerance;
- ``refused``: the strategy refused the model (an error lightning_dist raises on purpose, with the message the user
  gets): the strategy does not apply;
- ``defect``: verify reports a difference, or a run crashed or hung (its table or error is recorded).

Results go to ``benchmarks/results/verify/verify.json`` after every cell; at the end, the table to the region between
:data:`~benchmarks.verify.table.START` and :data:`~benchmarks.verify.table.END` of ``docs/verify.md`` (only that
region is written; a page without the markers is left alone and the table goes to ``docs/verify_matrix.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.compatibility.cells import _BUG_TYPES, COLUMNS, FP32_TOLERANCE, Column
from benchmarks.compatibility.runner import versions
from benchmarks.verify.models import FP64_COLUMNS, ROWS, build_data, build_module
from benchmarks.verify.table import update_doc

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "verify" / "verify.json"
DOCS = ROOT / "docs" / "verify.md"
COMPAT_RESULTS = ROOT / "benchmarks" / "results" / "compatibility" / "compatibility.json"
DTYPES = ("float32", "float64")
RUN_TIMEOUT = 600.0  # seconds each of a cell's runs may take (2 shared cores: a run takes ~15-60 s)
_BUGS = tuple(t.__name__ for t in _BUG_TYPES)


def strategy_of(column: Column) -> Any:
    """The ``strategy=`` argument of ``column``. ``fsdp2_hybrid`` replicates across nodes; verify's runs are on one
    machine, so its two simulated nodes become ``data_parallel_replicate_size=2`` (the same mesh)."""
    if column.nodes > 1:
        from lightning_dist import FSDP2Strategy

        return FSDP2Strategy(sharding="hybrid", data_parallel_replicate_size=column.nodes)
    return column.make()


def run_cell(model: str, module: Any, column_label: str, dtype: str, workdir: Path, cache: Path) -> dict[str, Any]:
    """``verify`` of row ``model`` (its ``module``, the same object in every cell of a run) under ``column_label``
    in ``dtype``; the cell's record (see :func:`classify`)."""
    import lightning_dist

    column = COLUMNS[column_label]
    data = build_data(model, column.batch_replicas)
    # a model that computes parts in float32 inside a fp64 run is held to the fp32 tolerance (as the compat matrix)
    tolerance = FP32_TOLERANCE if dtype == "float64" and ROWS[model].why_fp32 else None
    load = os.getloadavg()[0]
    report = lightning_dist.verify(
        module,
        data,
        strategy=strategy_of(column),
        devices=column.devices,
        steps=3,
        tolerance=tolerance,
        dtype="float64" if dtype == "float64" else None,
        workdir=str(workdir),
        timeout=RUN_TIMEOUT,
        reference_cache=str(cache),
        accelerator="cpu",
    )
    record = classify(report, workdir)
    record["load_average"] = round(load, 1)
    if record["outcome"] == "passed":
        shutil.rmtree(workdir, ignore_errors=True)
    return record


def classify(report: Any, workdir: Path) -> dict[str, Any]:
    """A verify report as a cell's record: ``outcome``, ``seconds``, ``mesh``, ``tolerance``, ``max_diff`` (the
    largest judged difference), and for a refusal or defect what the user is told."""
    mesh = re.search(r"\((.*)\)$", report.strategy)
    record: dict[str, Any] = {
        "seconds": round(report.seconds, 1),
        "mesh": mesh.group(1) if mesh else "",
        "tolerance": report.tolerance,
        "tolerance_reason": report.tolerance_reason,
    }
    judged = [row for row in report.rows if row.tolerance != float("inf")]
    if judged:
        worst = max(judged, key=lambda row: row.difference)
        record["max_diff"] = worst.difference
        record["max_diff_at"] = f"{worst.quantity}, {worst.when}" + (f" ({worst.worst[0][0]})" if worst.worst else "")
    record["reference_reused"] = any("reference run was reused" in note for note in report.notes)
    if report.passed:
        return {"outcome": "passed", **record}
    if report.failure:
        role = "reference" if report.failure.startswith("the reference run") else "candidate"
        failure = run_error(workdir / f"{role}.log")
        hung = "did not finish" in report.failure
        refused = role == "candidate" and not hung and failure["deliberate"]
        record.update(outcome="refused" if refused else "defect", error=failure["error"], when=failure["when"])
        if not refused:
            run = "the reference run" if role == "reference" else "the strategy's run"
            record["defect"] = report.failure if hung else f"{run} failed ({failure['where']})"
        return record
    first = report.first_difference
    record.update(
        outcome="defect",
        defect=report.summary(),
        first_difference={"quantity": first.quantity, "when": first.when, "difference": first.difference},
        causes=report.causes,
        table=report.table(),
    )
    return record


def run_error(log: Path) -> dict[str, Any]:
    """The last traceback of a run's log: its error line, where it was raised, whether lightning_dist raised it on
    purpose (its own exception type, or a ``raise`` statement of the package, and not a type that signals a bug,
    the compat matrix's rule), and whether the ranks had started (Lightning's "Initializing distributed" line)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    text = re.sub(r"^\[rank\d+\]: ", "", text, flags=re.MULTILINE)  # torch's prefix on each line of a rank's error
    block = text.rsplit("Traceback (most recent call last):", 1)[-1] if "Traceback" in text else ""
    matches = list(re.finditer(r'^  File "([^"]+)", line (\d+), in \S+\n(?:    (.*)\n)?', block, re.MULTILINE))
    frames = [m.groups(default="") for m in matches]
    after = block[matches[-1].end() :] if matches else block  # the error line and its message's further lines
    lines = [line for line in after.splitlines() if not re.fullmatch(r"\s*[\^~]+\s*", line)]  # no ^^^ markers
    start = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    error = " ".join(line.strip() for line in lines[start:end])
    if not error:
        error = next(iter(reversed([line for line in text.splitlines() if line.strip()])), "no output")
    error_type = error.split(":", 1)[0]
    path, lineno, code = frames[-1] if frames else ("", "", "")
    package = f"{os.sep}lightning_dist{os.sep}"
    explicit = package in path and code.strip().startswith("raise ") and code.strip() != "raise"
    own_type = error_type.startswith("lightning_dist.")
    deliberate = (explicit or own_type) and error_type.rsplit(".", 1)[-1] not in _BUGS
    launched = "Initializing distributed" in text.split(block, 1)[0] if block else "Initializing distributed" in text
    where = f"{Path(path).name}:{lineno}" if path else "no traceback"
    return {"error": " ".join(error.split())[:1500], "deliberate": deliberate, "where": where,
            "when": "after launch" if launched else "before launch"}  # fmt: skip


def compat_outcome(model: str, column: str) -> str | None:
    """The compatibility matrix's recorded outcome of the same cell (fp64), if it has the model."""
    if not COMPAT_RESULTS.exists():
        return None
    cells = json.loads(COMPAT_RESULTS.read_text()).get("cells", {})
    return cells.get(model, {}).get(column, {}).get("outcome")


def save(results_path: Path, dtype: str, model: str, column: str, record: dict[str, Any]) -> None:
    """Merge one cell into the recorded results (rewritten after every cell, so a cut-off run keeps what ran)."""
    recorded = json.loads(results_path.read_text()) if results_path.exists() else {}
    cells = recorded.setdefault("cells", {})
    row = cells.setdefault(dtype, {}).setdefault(model, {})
    row[column] = record
    cells[dtype][model] = {c: row[c] for c in COLUMNS if c in row}
    recorded["versions"] = versions()
    recorded["updated"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.with_suffix(".tmp").write_text(json.dumps(recorded, indent=1) + "\n")
    os.replace(results_path.with_suffix(".tmp"), results_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--columns", default=None, help="comma-separated compat columns (default: all for float32,"
                        f" {', '.join(FP64_COLUMNS)} for float64)")  # fmt: skip
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--render", action="store_true", help="only render the docs table from the recorded results")
    parser.add_argument("--workdir", type=Path, default=None, help="the run's folder (cells' logs, reference cache)")
    args = parser.parse_args(argv)
    if not args.render:
        models = args.models.split(",")
        columns = (args.columns or ",".join(COLUMNS if args.dtype == "float32" else FP64_COLUMNS)).split(",")
        unknown = [m for m in models if m not in ROWS] + [c for c in columns if c not in COLUMNS]
        if unknown:
            parser.error(f"unknown model or column {unknown}: models are {list(ROWS)}, columns {list(COLUMNS)}")
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ld_verify_matrix_"))
        print(f"verify matrix: {len(models) * len(columns)} cells ({args.dtype}), work folder {workdir}", flush=True)
        for model in models:
            module = build_module(model)
            for column in columns:
                cell_dir = workdir / "cells" / args.dtype / f"{model}@{column}"
                start = time.monotonic()
                try:
                    record = run_cell(model, module, column, args.dtype, cell_dir, workdir / "reference_cache")
                except Exception as error:  # noqa: BLE001  (verify itself failing is a cell outcome too)
                    record = {"outcome": "defect", "defect": "verify raised", "error": f"{type(error).__name__}: "
                              f"{error}", "seconds": round(time.monotonic() - start, 1)}  # fmt: skip
                record["compat"] = compat_outcome(model, column)
                save(args.results, args.dtype, model, column, record)
                print(f"{args.dtype} {model} × {column}: {record['outcome']} {record['seconds']} s"
                      f" {record.get('max_diff', '')} {record.get('defect', '')} {record.get('error', '')[:300]}",
                      flush=True)  # fmt: skip
                if record["outcome"] == "defect" and "table" in record:
                    print(record["table"], flush=True)
    recorded = json.loads(args.results.read_text()) if args.results.exists() else {}
    print(f"table written to {update_doc(args.docs, recorded)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
