"""The compatibility matrix: every strategy family × third-party models (tiny configs), each cell trained for a few
steps against one process, or refused; the results regenerate ``docs/compatibility.md``.

Usage (from the repository root)::

    python -m benchmarks.compatibility                                # every cell; rewrites the results and the page
    python -m benchmarks.compatibility --models gpt2,vit --columns pipeline   # some cells, merged into the results
    python -m benchmarks.compatibility --render                       # the page from the recorded results only

The one-process references run first, in one process, followed there by what ``Trainer(devices=N).fit`` does in the
launching process before it starts the ranks, for every cell (a refusal there is "before launch"). The cells that
pass are launched, one launch per layout of processes (:mod:`benchmarks.compatibility.worker` on each rank,
torchrun-style). A launch that dies or hangs costs only its current cell (recorded as a defect with the rank's last
error line); the remaining cells get a new launch.
Cell outcomes are defined in :mod:`benchmarks.compatibility.cells`, the models in :mod:`benchmarks.compatibility.models`, the
page in :mod:`benchmarks.compatibility.table`.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.common.launch import (
    LAUNCHER_VARIABLES,
    child_env,
    failed_ranks,
    run_command,
    start_ranks,
    stop_processes,
    wait_ranks,
)
from benchmarks.common.layout import Layout
from benchmarks.compatibility.cells import COLUMNS
from benchmarks.compatibility.models import MODELS
from benchmarks.compatibility.table import render

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("worker.py")
RESULTS = ROOT / "benchmarks" / "results" / "compatibility" / "compatibility.json"
DOCS = ROOT / "docs" / "compatibility.md"
CELL_TIMEOUT = 300.0  # seconds one cell may take before its launch is taken as hung (2 shared cores: ~10-60 s)
_KEPT = ("outcome", "when", "error", "defect", "max_diff", "loss_diff", "param_diff", "mesh", "seconds")


def run_references(models: list[str], cells: list[tuple[str, str]], workdir: Path, timeout: float) -> dict[str, str]:
    """Train each model in one process, then run each cell's pre-launch checks there (see
    :func:`benchmarks.compatibility.worker.prelaunch`). Returns the models whose reference failed, with the reason."""
    env = child_env(drop=(*LAUNCHER_VARIABLES, "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED"))
    log_path = workdir / "log_references.txt"
    names = ",".join(f"{model}@{column}" for model, column in cells)
    cmd = [
        sys.executable,
        str(WORKER),
        "--references",
        ",".join(models),
        "--prelaunch",
        names,
        "--workdir",
        str(workdir),
    ]
    with open(log_path, "a") as log:
        run_command(cmd, env=env, log=log, timeout=timeout * (len(models) + 1) + 10 * len(cells))
    missing = [m for m in models if not (workdir / "reference" / f"{m}.json").exists()]
    return dict.fromkeys(missing, f"the one-process reference failed ({_last_error(log_path)})")


def run_cells(cells: list[tuple[str, str]], workdir: Path, cell_timeout: float) -> dict[tuple[str, str], dict]:
    """Every ``(model, column)`` of ``cells`` (one layout of processes): one launch, and another for the remaining cells after
    a cell that ended its launch (a failure after launch, a crash or a hang)."""
    records: dict[tuple[str, str], dict[str, Any]] = {}
    remaining = list(cells)
    while remaining:
        ended = _launch(remaining, workdir, cell_timeout)
        done = 0
        for key in list(remaining):
            ranks = _rank_records(workdir, *key)
            if ranks is None:
                break
            records[key] = merge_ranks(ranks)
            remaining.remove(key)
            done += 1
        if remaining and ended is not None:  # the launch died or hung in this cell
            records[remaining.pop(0)] = ended
        elif remaining and not done:
            break  # a clean exit without any result: the worker is broken, do not loop
    for key in remaining:
        records[key] = {"outcome": "defect", "defect": "not run: its launch ended without a result"}
    return records


def _launch(cells: list[tuple[str, str]], workdir: Path, cell_timeout: float) -> dict[str, Any] | None:
    """One launch running ``cells`` in order. Returns the current cell's record when the launch died or hung."""
    world, nodes = COLUMNS[cells[0][1]].devices, COLUMNS[cells[0][1]].nodes
    current = workdir / "current"
    current.unlink(missing_ok=True)
    names = ",".join(f"{model}@{column}" for model, column in cells)
    cmd = [sys.executable, str(WORKER), "--cells", names, "--workdir", str(workdir)]
    log_paths = [workdir / f"log_ws{world}_n{nodes}_rank{r}.txt" for r in range(world)]
    starts = [path.stat().st_size if path.exists() else 0 for path in log_paths]  # this launch's part of each log
    logs = [open(path, "a") for path in log_paths]  # noqa: SIM115  (closed below)
    procs = start_ranks(cmd, Layout(world, nodes), logs, threads=1)
    seen, since = None, time.monotonic()

    def problem() -> dict[str, Any] | None:
        nonlocal seen, since
        now_at = current.read_text() if current.exists() else None
        if now_at != seen:
            seen, since = now_at, time.monotonic()
        if time.monotonic() - since > cell_timeout:
            return {"outcome": "defect", "defect": f"hung: no result after {cell_timeout:.0f} s",
                    "error": _last_error(log_paths[0], starts[0])}  # fmt: skip
        return _failed_rank(procs, log_paths, starts)

    try:
        failure = wait_ranks(procs, problem) or _failed_rank(procs, log_paths, starts)
    finally:
        stop_processes(procs, logs)
    return failure


def _failed_rank(procs: list[subprocess.Popen], log_paths: list[Path], starts: list[int]) -> dict[str, Any] | None:
    failed = failed_ranks(procs)
    if not failed:
        return None
    r = failed[0]
    return {"outcome": "defect", "defect": f"rank {r} exited with code {procs[r].returncode}",
            "error": _last_error(log_paths[r], starts[r])}  # fmt: skip


def _rank_records(workdir: Path, model: str, column: str) -> list[dict[str, Any]] | None:
    paths = [workdir / "cells" / f"{model}@{column}.rank{r}.json" for r in range(COLUMNS[column].devices)]
    if not all(p.exists() for p in paths):
        return None
    return [json.loads(p.read_text()) for p in paths]


_KNOCK_ON = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out", "timed out")


def merge_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record; when the ranks disagree, a defect showing the first rank that failed for its own reason (not
    because a peer closed the connection)."""
    record = {k: v for k, v in ranks[0].items() if k in _KEPT}
    outcomes = [(r["outcome"], r.get("when"), r.get("error")) for r in ranks]
    if len(set(outcomes)) > 1:
        failed = [i for i, r in enumerate(ranks) if r["outcome"] != "parity"]
        own = [i for i in failed if not any(text in (ranks[i].get("error") or "") for text in _KNOCK_ON)]
        root = (own or failed or [0])[0]
        record.update(outcome="defect", defect=f"ranks disagree ({len(failed)} of {len(ranks)} failed)",
                      when=ranks[root].get("when"), error=f"rank {root}: {ranks[root].get('error', '')}")  # fmt: skip
    return record


def _last_error(log: Path, start: int = 0) -> str:
    """The last line of a log (from byte ``start``) that looks like an exception (``SomethingError: ...``), else its
    last line."""
    text = log.read_bytes()[start:].decode(errors="replace") if log.exists() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if ": " in line and line.split(":", 1)[0].rsplit(".", 1)[-1].endswith(
        ("Error", "Exception", "Interrupt"))]  # fmt: skip
    return (errors or lines or ["(no output)"])[-1][:600]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("torch", "lightning", "transformers", "litgpt"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def run_matrix(
    models: list[str], columns: list[str], workdir: Path, cell_timeout: float = CELL_TIMEOUT
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{model: {column: record}}`` for every cell of ``models`` × ``columns``: the references and every cell's
    pre-launch checks in one process, then the cells that pass them, one launch per layout of processes (more after
    a cell that ends its launch)."""
    everything = [(m, c) for c in columns for m in models]
    failed = run_references(models, everything, workdir, cell_timeout)
    cells: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in models}
    todo = []
    for model, column in everything:
        checked = workdir / "cells" / f"{model}@{column}.prelaunch.json"
        if model in failed:
            cells[model][column] = {"outcome": "defect", "defect": failed[model]}
        elif not checked.exists():
            cells[model][column] = {"outcome": "defect", "defect": "the pre-launch checks did not finish",
                                    "error": _last_error(workdir / "log_references.txt")}  # fmt: skip
        elif (ended := json.loads(checked.read_text())["ended"]) is not None:
            cells[model][column] = {k: v for k, v in ended.items() if k in _KEPT}
        else:
            todo.append((model, column))
    for layout in sorted({(COLUMNS[c].devices, COLUMNS[c].nodes) for c in columns}):
        launch = [(m, c) for m, c in todo if (COLUMNS[c].devices, COLUMNS[c].nodes) == layout]
        if launch:
            for (model, column), record in run_cells(launch, workdir, cell_timeout).items():
                cells[model][column] = record
    return cells


def merge_results(recorded: dict[str, Any], cells: dict[str, dict[str, dict[str, Any]]], seconds: float,
                  full: bool) -> dict[str, Any]:  # fmt: skip
    """The recorded results with ``cells`` replacing theirs; a full run also records its wall time."""
    merged = {"cells": {}, **{k: v for k, v in recorded.items() if k != "cells"}}
    for model in MODELS:
        row = dict(recorded.get("cells", {}).get(model, {}))
        row.update(cells.get(model, {}))
        merged["cells"][model] = {c: row[c] for c in COLUMNS if c in row}
    merged["versions"] = versions()
    merged["updated"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if full:
        merged["full_run_seconds"] = round(seconds)
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--columns", default=",".join(COLUMNS), help=f"comma-separated, of: {', '.join(COLUMNS)}")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--render", action="store_true", help="only regenerate the page from the recorded results")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the logs here (default: a temporary folder)")
    parser.add_argument("--cell-timeout", type=float, default=CELL_TIMEOUT)
    args = parser.parse_args(argv)
    recorded = json.loads(args.results.read_text()) if args.results.exists() else {}
    if not args.render:
        models, columns = args.models.split(","), args.columns.split(",")
        unknown = [m for m in models if m not in MODELS] + [c for c in columns if c not in COLUMNS]
        if unknown:
            parser.error(f"unknown model or column {unknown}: models are {list(MODELS)}, columns {list(COLUMNS)}")
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ld_compat_"))
        workdir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        cells = run_matrix(models, columns, workdir, args.cell_timeout)
        full = set(models) == set(MODELS) and set(columns) == set(COLUMNS)
        recorded = merge_results(recorded, cells, time.monotonic() - start, full)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(recorded, indent=1) + "\n")
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        for model, row in cells.items():
            for column, record in row.items():
                print(f"{model} × {column}: {record['outcome']} {record.get('when', '')} "
                      f"{record.get('max_diff', '')} {record.get('defect', '')} {record.get('error', '')[:200]}")  # fmt: skip
    args.docs.parent.mkdir(parents=True, exist_ok=True)
    args.docs.write_text(render(recorded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
