"""The measured tables of ``docs/performance.md`` (between :data:`SECTION_START` and :data:`SECTION_END`), kept
current by ``python -m benchmarks.run --update-docs``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.suite.analysis import analyze, observations
from benchmarks.suite.tables import activation_table, comm_table, memory_table, overhead_table, targets_summary

SECTION_START = "<!-- benchmarks:start -->"
SECTION_END = "<!-- benchmarks:end -->"


def _load_text(meta: dict[str, Any]) -> str:
    """``"<start> at the start, <end> at the end"``, flagged when the host was busier than its core count."""
    start, end = meta.get("load_average_at_start"), meta.get("load_average_at_end")
    text = f"{start if start is not None else 'not recorded'} at the start, {end if end is not None else 'not recorded'} at the end"
    loads = [x for x in (start, end) if x is not None]
    if start is not None and start > (meta.get("cpu_count") or 1):
        text += " — other jobs were sharing the host"
    elif loads and max(loads) > (meta.get("cpu_count") or 1):
        text += " — the benchmark's own processes oversubscribed the cores by the end"
    return text


def performance_section(results: dict[str, Any], analysis: dict[str, list[dict[str, Any]]] | None = None) -> str:
    """The measured tables for docs/performance.md (between :data:`SECTION_START` and :data:`SECTION_END`):
    targets, step-time ratios, state per rank for the largest model, activations, and bytes at the largest N."""
    analysis = analysis if analysis is not None else analyze(results)
    meta, cfg = results["meta"], results["config"]
    largest, ws_max = cfg["sizes"][-1], max(results["world_sizes"])
    obs = observations(results)
    lines = [
        SECTION_START,
        (
            f"Measured {meta['started']} with `{meta['command']}` on {meta['device_name']} ({meta['cpu_count']} cores,"
            f" 1-min load average {_load_text(meta)}), `{cfg['precision']}`, {cfg['batch_size']} samples per rank. Full report:"
            " [benchmarks/results/suite/report.md](../benchmarks/results/suite/report.md)."
        ),
        "",
        "**Targets**",
        "",
        *targets_summary(analysis, results),
        "",
        "**Step time, as ratios** (median of interleaved repeats"
        + (
            f"; N > {meta['cpu_count']} oversubscribes the {meta['cpu_count']} cores)"
            if meta["device"] == "cpu" and ws_max > (meta["cpu_count"] or 1)
            else ")"
        ),
        "",
        overhead_table([r for r in analysis["overhead"] if r["status"] == "ok"]),
        "",
        f"**State per rank** ({largest})",
        "",
        memory_table([r for r in analysis["memory"] if r["size"] == largest]),
        "",
        f"**Activation memory per rank** (N={ws_max})",
        "",
        activation_table([r for r in analysis["activations"] if r["world_size"] == ws_max]),
        "",
        (
            f"**Communication per rank per step** (N={ws_max}, {results['layouts'][str(ws_max)]['num_nodes']} simulated"
            " nodes)"
        ),
        "",
        comm_table([r for r in analysis["comm"] if r["world_size"] == ws_max]),
        "",
    ]
    if obs:
        lines += ["**Observations**", "", *[f"- {o}" for o in obs], ""]
    lines.append(SECTION_END)
    return "\n".join(lines)


def update_performance_doc(results: dict[str, Any], doc: Path) -> bool:
    """Replace the text between the section markers of ``doc`` with :func:`performance_section`; ``False`` if
    there are no markers."""
    return replace_marked_block(doc, SECTION_START, SECTION_END, performance_section(results))


def replace_marked_block(doc: Path, start: str, end: str, block: str) -> bool:
    """Replace the first ``start`` ... ``end`` block of ``doc`` (markers included) with ``block``, which carries the
    markers itself; the rest of the file is left as it is. ``False`` (nothing written) if ``doc`` has no markers."""
    text = doc.read_text() if doc.exists() else ""
    if start not in text or end not in text.split(start, 1)[1]:
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(head + block + tail)
    return True
