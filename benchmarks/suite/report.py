"""Turn the raw results of a benchmark invocation (``results.json``) into tables (``report.md``) and a plot
(``scaling.png``). Everything here is a pure function of the results dict, so reports can be regenerated
(``python -m benchmarks.run --report-only results.json``) and tested on a known dict. The rows come from
:mod:`benchmarks.suite.analysis`, their markdown from :mod:`benchmarks.suite.tables`; the section of ``docs/performance.md`` is
:mod:`benchmarks.suite.docs_section`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.suite.analysis import TARGET_TIME_RATIO, MiB, analyze, observations
from benchmarks.suite.tables import (
    activation_table,
    breakdown_table,
    comm_table,
    memory_table,
    overhead_table,
    targets_summary,
    throughput_table,
)


def to_markdown(results: dict[str, Any], analysis: dict[str, list[dict[str, Any]]] | None = None) -> str:
    """The full report."""
    analysis = analysis if analysis is not None else analyze(results)
    meta, cfg = results["meta"], results["config"]
    out = [
        "# lightning_dist benchmark report",
        "",
        f"Command: `{meta['command']}`  ",
        f"Started {meta['started']}, took {meta.get('elapsed_s', 0):.0f} s. Device: {meta['device_name']}"
        f" ({meta['cpu_count']} CPU cores; 1-min load average {meta.get('load_average_at_start', 'not recorded')} at the start,"
        f" {meta.get('load_average_at_end', 'not recorded')} at the end), torch {meta['torch']}, lightning {meta['lightning']}. Precision"
        f" `{cfg['precision']}`, {cfg['batch_size']} samples per rank per step,"
        f" {cfg.get('threads_per_rank', 1)} thread(s) per rank, model sizes "
        + ", ".join(f"{n} ({s['num_parameters']:,} params)" for n, s in results["sizes"].items())
        + ".",
        "",
        "## Targets",
        "",
        *targets_summary(analysis, results),
        "",
    ]
    unavailable = [f"- `{n}`: {w['reason']}" for n, w in results["workloads"].items() if not w["available"]]
    errors = [f"- N={ws}: {err}" for ws, err in results.get("launch_errors", {}).items()]
    failed = [
        f"- `{r['workload']}` {r['size']} N={r['world_size']} ({r['mode']}): {r['error']}"
        for r in results["runs"]
        if "error" in r
    ]
    if unavailable or errors or failed:
        out += ["## Not measured", "", *unavailable, *errors, *failed, ""]
    out += [
        *(["## Observations", "", *[f"- {o}" for o in observations(results)], ""] if observations(results) else []),
        "## Workloads",
        "",
        *[f"- `{n}`: {w['description']}" for n, w in results["workloads"].items()],
        "",
        "Layouts: "
        + ", ".join(
            f"N={ws}: {lay['num_nodes']} node(s) × {lay['ranks_per_node']} ranks"
            for ws, lay in results["layouts"].items()
        )
        + " (several nodes are simulated on one host; cross-node bytes follow that topology).",
        "",
        "## Step-time overhead (ratios)",
        "",
        (
            f"Each configuration ran {cfg['repeats']} times, interleaved (the order rotates every repeat), with"
            f" {cfg['warmup']} warm-up steps excluded and {cfg['steps']} timed steps; a repeat's value is its median step"
            " time, the ratio is median(ours) / median(baseline) over repeats, the spread is that of the per-repeat ratios."
            " The CPU-time ratio is the same statistic over process CPU seconds per step (every thread of rank 0):"
            " it leaves out waiting for peers and for a free core, so it is steadier than wall time on a shared or"
            " oversubscribed host; the target is stated on wall time."
        ),
    ]
    if meta["device"] == "cpu":
        out.append(
            f"On this CPU host ({meta['cpu_count']} cores) world sizes above {meta['cpu_count']} oversubscribe the"
            " cores, so their time ratios mostly measure scheduling noise; other processes sharing the machine add"
            " noise to every time figure. Bytes and memory below are exact regardless."
        )
    out += ["", overhead_table(analysis["overhead"]), ""]
    out += ["## Throughput", "", throughput_table(analysis["throughput"]), ""]
    out += [
        "## Memory per rank",
        "",
        (
            "State = parameters + gradients + optimizer state this rank holds after an optimizer step"
            " (`lightning_dist.profiling.state_bytes`: storages counted once, padding included). Ideal = unsharded"
            " fp32 parameters + gradients + AdamW's two moments, divided by N (only a target for sharded workloads:"
            " DDP replicates, tensor parallel replicates embeddings and norms). Peak RSS: the process's peak resident"
            " memory during the measured step (Linux `VmHWM` reset through `/proc/self/clear_refs` after `malloc_trim`),"
            " which includes the Python interpreter, torch and the process group; Δ = peak minus RSS at the step's"
            " start."
        ),
        "",
        memory_table(analysis["memory"]),
        "",
        "### Activation memory",
        "",
        (
            "Bytes of the distinct storages autograd saves for backward during the measured step's forward (parameters"
            " and views of them excluded; with checkpointing, the block inputs the checkpoint keeps are included and"
            " what is saved inside a block is not): `fsdp2` vs `fsdp2_activation_checkpointing`, per rank."
        ),
        "",
        activation_table(analysis["activations"]),
        "",
        "## Communication per rank per step",
        "",
        (
            "Measured with `lightning_dist.profiling.CommCounter` over one optimizer step after a warm-up step: `sent` ="
            " bytes this rank sends (ring/direct-exchange model: all-gather and reduce-scatter (N-1)/N of the full"
            " tensor, all-reduce 2(N-1)/N), cross-node = the part addressed to ranks on other nodes. Theory columns"
            " (see `benchmarks/suite/theory.py`): ZeRO-3 `3M(N-1)/N`; FSDP2 as applied (root module gathered once, not"
            " re-gathered in backward) `(3M_blocks + 2M_root)(N-1)/N`; DDP `2M(N-1)/N`; tensor parallel"
            " `L·k·2(t-1)/t·B·S·H·b` with k = 4 all-reduces per block (Megatron) or 6 for this GPT's separate q/k/v"
            " projections (compared with the measured all-reduces on the TP group in forward/backward); ZeRO++"
            " cross-node `(1 + 0 + 0.5)·P·(N-r)/N` bytes (int8 weights, hpZ, int4 gradients — the paper's 0.75M"
            " against ZeRO-3's 3M in fp16 units; against an fp32 baseline 0.125). Every run also all-reduces the"
            " logged loss (4 bytes)."
        ),
        "",
        comm_table(analysis["comm"]),
        "",
    ]
    largest_size, largest_ws = cfg["sizes"][-1], max(results["world_sizes"])
    out += [
        f"### By collective and group ({largest_size}, N={largest_ws})",
        "",
        breakdown_table(results, largest_size, largest_ws),
        "",
        "## Scaling",
        "",
        "![scaling](scaling.png)" if results.get("plot") else f"(no plot: {results.get('plot_message', 'n/a')})",
        "",
        (
            "Per-rank state against N and per-rank bytes against model size are in the tables above; the plot shows"
            " them for every measured size and world size."
        ),
        "",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------ plot


def plot(results: dict[str, Any], analysis: dict[str, list[dict[str, Any]]], path: Path) -> str | None:
    """Write the scaling plot; returns ``None`` on success or the reason it was not drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'lightning-dist[bench]' or pip install matplotlib)"
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    sizes = results["config"]["sizes"]
    mem = analysis["memory"]
    ax = axes[0][0]
    for name in sorted({r["workload"] for r in mem}):
        for size in sizes:
            pts = sorted(
                (r["world_size"], r["sharded_total"] / MiB) for r in mem if r["workload"] == name and r["size"] == size
            )
            if pts and size == sizes[-1]:
                ax.plot(*zip(*pts), marker="o", label=name)
    ideal = sorted({(r["world_size"], r["ideal"] / MiB) for r in mem if r["size"] == sizes[-1]})
    if ideal:
        ax.plot(*zip(*ideal), "k--", label="ideal full/N")
    ax.set(title=f"per-rank state ({sizes[-1]})", xlabel="world size N", ylabel="MiB", yscale="log")
    ax.legend(fontsize=7)

    ax = axes[0][1]
    comm = analysis["comm"]
    ws_max = max(results["world_sizes"])
    for name in sorted({r["workload"] for r in comm}):
        pts = sorted(
            (results["sizes"][r["size"]]["num_parameters"], r["sent"] / MiB)
            for r in comm
            if r["workload"] == name and r["world_size"] == ws_max and r["sent"]
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(
        title=f"sent bytes per rank per step (N={ws_max})",
        xlabel="parameters",
        ylabel="MiB",
        xscale="log",
        yscale="log",
    )
    ax.legend(fontsize=7)

    ax = axes[1][0]
    for ours, base in results["comparisons"]:
        for size in results["config"]["timing_sizes"]:
            pts = sorted(
                (r["world_size"], r["ratio_of_medians"])
                for r in analysis["overhead"]
                if r["status"] == "ok" and r["ours"] == ours and r["baseline"] == base and r["size"] == size
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{ours}/{base} ({size})")
    ax.axhline(TARGET_TIME_RATIO, color="k", ls="--", lw=0.8)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set(title="step-time ratio (median of interleaved repeats)", xlabel="world size N", ylabel="ratio")
    ax.legend(fontsize=7)

    ax = axes[1][1]
    acts = analysis["activations"]
    for label, key in (("without AC", "without_ac"), ("with AC", "with_ac")):
        pts = sorted(
            (results["sizes"][r["size"]]["num_parameters"], r[key] / MiB) for r in acts if r["world_size"] == ws_max
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    ax.set(title=f"activation memory per rank (N={ws_max})", xlabel="parameters", ylabel="MiB", xscale="log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def write_report(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``report.md`` and ``scaling.png`` (when matplotlib is installed) next to the results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    analysis = analyze(results)
    png = out_dir / "scaling.png"
    message = plot(results, analysis, png)
    results["plot"] = message is None
    if message is not None:
        results["plot_message"] = message
        print(f"benchmarks: no plot written: {message}")
    md = out_dir / "report.md"
    md.write_text(to_markdown(results, analysis))
    paths = {"report": md}
    if message is None:
        paths["plot"] = png
    return paths
