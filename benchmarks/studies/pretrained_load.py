"""Host memory of starting from pretrained weights (issue 42): ``initial_weights`` against ``from_pretrained`` on
every rank, a stock ``LlamaForCausalLM`` of 2 GB in fp32 saved in bf16, fp32 weights (``32-true``) under
``FSDP2Strategy`` on 4 CPU processes, measured by the end of setup (``on_train_start``, before the first step).

    python -m benchmarks.pretrained_load                       # writes the folder once, under --workdir
    python -m benchmarks.pretrained_load --workdir /data/pl    # another place for the 1 GB folder

Each way is one launch of its own processes (:mod:`.pretrained_load_rank`, started by ``run_ranks``), so the peaks
are separate. A process's ``ru_maxrss`` starts at its parent's peak (Linux keeps the larger of the two across
``fork``/``exec``), so the folder is written by a process of its own and the ranks are started by this lean one,
not by a Lightning rank that already holds a model; each rank also records ``VmHWM``, its own address space's peak.

Targets: ``initial_weights``'s peak ≤ the rank's baseline (``ru_maxrss`` after the imports) + a quarter of the fp32
model + the largest fp32 tensor, and ≤ 0.6 × ``from_pretrained``'s peak (each the largest over the ranks).
Writes ``benchmarks/results/studies/pretrained_load.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.launch import ROOT, run_command, run_ranks

WAYS = ("initial_weights", "from_pretrained")
RANKS = 4
GIB = 1024**3
KIB = 1024
# hidden 2048, 8 layers, intermediate 5632: 508.6 M parameters, 2.03 GB in fp32, 1.02 GB in bf16
LLAMA = {
    "hidden_size": 2048, "num_hidden_layers": 8, "intermediate_size": 5632, "num_attention_heads": 16,
    "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 2048,
}  # fmt: skip
SHARD_SIZE = "500MB"
RESULTS = ROOT / "benchmarks" / "results" / "studies"
TARGET_RATIO = 0.6


def write_folder(folder: Path) -> None:
    """A random-valued ``LlamaForCausalLM`` saved in bf16, built in bf16 (on the meta device, then created and
    initialized in place) so this process never holds an fp32 copy."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**LLAMA, dtype="bfloat16")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # the RMSNorm weights
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.normal_(0, 0.02, generator=generator)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size=SHARD_SIZE)
    partial.rename(folder)


def ensure_folder(workdir: Path) -> Path:
    """The bf16 folder, written once (in a process of its own) and then reused."""
    folder = workdir / "llama_2gb_bf16"
    if not (folder / "model.safetensors.index.json").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.studies.pretrained_load", "--write-folder", str(folder)]
        proc = run_command(cmd)
        if proc.returncode != 0:
            raise RuntimeError(f"writing {folder} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return folder


def model_bytes(folder: Path) -> dict[str, Any]:
    """The model in fp32 as the files describe it: total bytes, the largest tensor, how many files."""
    from lightning_dist.checkpoint.pretrained import read_pretrained_files

    files = read_pretrained_files(folder)
    sizes = {key: 4 * _numel(t.shape) for key, t in files.tensors.items()}
    largest = max(sizes, key=sizes.__getitem__)
    return {
        "parameters": sum(sizes.values()) // 4,
        "fp32_bytes": sum(sizes.values()),
        "largest_tensor": largest,
        "largest_fp32_bytes": sizes[largest],
        "files": len(files.files),
        "file_bytes": sum(f.stat().st_size for f in files.files),
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def launch(way: str, folder: Path, out: Path, timeout: float) -> tuple[list[dict[str, Any]], float]:
    """One launch of ``RANKS`` processes for ``way``: every rank's record and the launch's wall time."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "benchmarks.studies.pretrained_load_rank", "--way", way, "--folder", str(folder),
           "--out", str(out)]  # fmt: skip
    start = time.perf_counter()
    run_ranks(cmd, RANKS, timeout=timeout)
    wall = time.perf_counter() - start
    records = [json.loads((out / f"{way}_rank{r}.json").read_text()) for r in range(RANKS)]
    for r in records:
        if r["check"]["differ"] or not r["check"]["elements"]:
            raise RuntimeError(f"{way}: rank {r['rank']}'s weights differ from the file's: {r['check']}")
    return records, wall


def summarize(records: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """The largest over the ranks of each figure (bytes), and the elements checked against the file."""

    def largest(get: Any) -> int:
        return max(get(r) for r in records) * KIB

    return {
        "peak": largest(lambda r: r["peak_kib"]["ru_maxrss"]),
        "baseline": largest(lambda r: r["baseline_kib"]["ru_maxrss"]),
        "growth": largest(lambda r: r["peak_kib"]["ru_maxrss"] - r["baseline_kib"]["ru_maxrss"]),
        "own_peak_vm_hwm": largest(lambda r: r["peak_kib"]["vm_hwm"]),
        "rss_at_train_start": largest(lambda r: r["stages_kib"]["train_start"]["vm_rss"]),
        "load_s": max(r["load_s"] for r in records),
        "read_s": max(r["read_s"] for r in records),
        "fit_to_train_start_s": max(r["fit_to_train_start_s"] for r in records),
        "launch_wall_s": wall,
        "elements_checked": sum(r["check"]["elements"] for r in records),
    }


def targets(model: dict[str, Any], ways: dict[str, dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's two targets for ``initial_weights``, each with its bound and PASS/FAIL; the first on every rank
    (its own baseline)."""
    allowance = model["fp32_bytes"] // RANKS + model["largest_fp32_bytes"]
    worst = max(records, key=lambda r: r["peak_kib"]["ru_maxrss"] - r["baseline_kib"]["ru_maxrss"])
    bound = worst["baseline_kib"]["ru_maxrss"] * KIB + allowance
    peak = ways["initial_weights"]["peak"]
    ratio = peak / ways["from_pretrained"]["peak"]
    return {
        "share_plus_largest": {
            "allowance": allowance,
            "worst_rank": worst["rank"],
            "peak": worst["peak_kib"]["ru_maxrss"] * KIB,
            "bound": bound,
            "pass": worst["peak_kib"]["ru_maxrss"] * KIB <= bound,
        },
        "ratio_to_from_pretrained": {"ratio": ratio, "bound": TARGET_RATIO, "pass": ratio <= TARGET_RATIO},
    }


def to_markdown(result: dict[str, Any]) -> str:
    model, ways, t = result["model"], result["ways"], result["targets"]
    iw, fp = ways["initial_weights"], ways["from_pretrained"]

    def gib(b: float) -> str:
        return f"{b / GIB:.2f}"

    rows = [
        ("peak host memory by the end of setup (`ru_maxrss`), GiB", "peak", gib),
        ("baseline: `ru_maxrss` after the imports, GiB", "baseline", gib),
        ("growth over the baseline, GiB", "growth", gib),
        ("the process's own peak (`VmHWM`), GiB", "own_peak_vm_hwm", gib),
        ("resident at `on_train_start` (`VmRSS`), GiB", "rss_at_train_start", gib),
        ("building the module + the fit's setup, s", "load_s", lambda s: f"{s:.1f}"),
        ("the read alone (`load_pretrained`; the `from_pretrained` call), s", "read_s", lambda s: f"{s:.1f}"),
    ]
    lines = [
        f"# Pretrained load: host memory per rank ({RANKS} CPU processes, fsdp2, `32-true`)",
        "",
        (
            f"A stock `LlamaForCausalLM` of {model['parameters'] / 1e6:.1f} M parameters ({gib(model['fp32_bytes'])} GiB"
            f" in fp32), saved in bf16 into {model['files']} files ({gib(model['file_bytes'])} GiB). Largest over the"
            " ranks; `python -m benchmarks.pretrained_load`."
        ),
        "",
        "| per rank (largest over the ranks) | `initial_weights` | `from_pretrained` on every rank | ratio |",
        "|---|---|---|---|",
    ]
    for label, key, fmt in rows:
        lines.append(f"| {label} | {fmt(iw[key])} | {fmt(fp[key])} | {iw[key] / fp[key]:.2f} |")
    share = t["share_plus_largest"]
    ratio = t["ratio_to_from_pretrained"]
    verdict = {True: "PASS", False: "FAIL"}
    lines += [
        "",
        "| target (`initial_weights`) | measured | bound | |",
        "|---|---|---|---|",
        (
            f"| peak ≤ baseline + model/{RANKS} + largest tensor (fp32: {gib(model['fp32_bytes'] / RANKS)} +"
            f" {gib(model['largest_fp32_bytes'])} GiB), worst rank ({share['worst_rank']}) |"
            f" {gib(share['peak'])} GiB | {gib(share['bound'])} GiB | {verdict[share['pass']]} |"
        ),
        (
            f"| peak ≤ {TARGET_RATIO} × `from_pretrained`'s | {ratio['ratio']:.2f} | {TARGET_RATIO} |"
            f" {verdict[ratio['pass']]} |"
        ),
        "",
        (
            "Per rank, GiB (baseline → after joining the process group → after the strategy's setup → at"
            " `on_train_start`, `ru_maxrss`):"
        ),
        "",
        "| way | rank | baseline | process group | strategy setup | train start | `VmHWM` | load s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for way, records in result["ranks"].items():
        for r in records:
            s = r["stages_kib"]
            cells = [r["baseline_kib"]["ru_maxrss"], s["process_group"]["ru_maxrss"], s["strategy_setup"]["ru_maxrss"],
                     s["train_start"]["ru_maxrss"], r["peak_kib"]["vm_hwm"]]  # fmt: skip
            shown = " | ".join(gib(c * KIB) for c in cells)
            lines.append(f"| `{way}` | {r['rank']} | {shown} | {r['load_s']:.1f} |")
    alone = result.get("read_in_one_process", {})
    if alone:
        cells = ", ".join(f"{k.split('_')[1]} thread(s): {v:.2f} s" for k, v in alone.items())
        lines += ["", f"The whole model read by one process, no strategy (`load_pretrained(..., threads=)`): {cells}."]
    lines += [
        "",
        (
            f"Every element of every rank's shards equals the file's ({iw['elements_checked']:,} and"
            f" {fp['elements_checked']:,} elements checked). The command's wall time: {result['wall_s']:.0f} s."
        ),
    ]
    return "\n".join(lines) + "\n"


def read_with_threads(folder: Path, repeats: int = 3) -> dict[str, float]:
    """One process, no strategy: the whole fp32 model's ``load_pretrained`` with 1 thread and with one per core
    (``read_threads(1)``), interleaved, the page cache warm; median seconds of each."""
    import statistics

    import torch
    import transformers

    from lightning_dist.checkpoint.pretrained import load_pretrained, read_threads

    config = transformers.LlamaConfig(**LLAMA)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    many = read_threads(1)
    times: dict[int, list[float]] = {1: [], many: []}
    for _ in range(repeats):
        for threads in times:
            start = time.perf_counter()
            load_pretrained(model, folder, threads=threads)
            times[threads].append(time.perf_counter() - start)
    return {f"threads_{t}_s": statistics.median(v) for t, v in times.items()}


def measure(workdir: Path, timeout: float) -> dict[str, Any]:
    start = time.perf_counter()
    folder = ensure_folder(workdir)
    model = model_bytes(folder)
    ranks: dict[str, list[dict[str, Any]]] = {}
    ways: dict[str, dict[str, Any]] = {}
    for way in WAYS:
        ranks[way], wall = launch(way, folder, workdir / "records", timeout)
        ways[way] = summarize(ranks[way], wall)
    return {
        "read_in_one_process": read_with_threads(folder),
        "model": {**model, "config": LLAMA, "saved_dtype": "bfloat16", "max_shard_size": SHARD_SIZE},
        "ranks_per_way": RANKS,
        "ways": ways,
        "targets": targets(model, ways, ranks["initial_weights"]),
        "ranks": ranks,
        "wall_s": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ld_pretrained_load")
    parser.add_argument("--out", type=Path, default=RESULTS / "pretrained_load.md", help="and .json beside it")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    parser.add_argument("--write-folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write_folder:
        write_folder(args.write_folder)
        return
    result = measure(args.workdir, args.timeout)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    markdown = to_markdown(result)
    args.out.write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
