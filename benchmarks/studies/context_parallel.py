"""Context-parallel attention, counted: per-rank activation memory, the longest sequence a per-rank budget holds,
and the bytes each rank sends per layer next to their formulas, for cp = 1, 2, 4 and each algorithm; and timed: the
step time of ``Trainer(strategy="context_parallel")`` at cp=2 against one process, as a CPU/gloo ratio.

Usage (from the repository root; 4 CPU processes over gloo for the counts, a few seconds; then 2 processes for the
step time, a few minutes on 2 cores)::

    python -m benchmarks.context_parallel                    # prints the tables
    python -m benchmarks.context_parallel --out benchmarks/results/studies/context_parallel.md
    python -m benchmarks.context_parallel --no-time          # the counts only

What is measured, on one attention layer (``q: [B, H, S/cp, D]``, ``k, v: [B, G, S/cp, D]``, causal, zigzag layout
for ring/all-gather, contiguous for Ulysses):

* **activation memory**: the bytes autograd keeps from forward to backward (distinct storages saved for backward
  while the layer runs, inputs included), per rank. Transient buffers (the ring's next K/V shard, the all-gathered
  K/V, Ulysses' full-sequence heads) live only during the call and are not included (docs: context_parallel).
* **longest sequence**: the largest ``S`` (a multiple of ``2·cp``) whose measured activation memory fits the budget,
  found from the measured bytes per local token and checked by measuring ``S`` (fits) and the next multiple (does
  not).
* **bytes sent**: the collectives' own counters (:func:`lightning_dist.parallel.context_parallel.attention.count_bytes_sent`),
  forward and backward, next to :func:`lightning_dist.parallel.context_parallel.attention.bytes_per_layer`.

The step time (:func:`time_step`, 2 processes): ``Trainer.fit`` of the example GPT (:data:`TIMED_MODEL`) on one
global batch and sequence length, once with ``context_parallel`` / ``context_parallel_allgather`` /
``context_parallel_ulysses`` over both processes (cp=2: each rank holds half of every sequence; FSDP2 over the cp
ranks averages the gradients) and once in one process (a ``SingleDeviceStrategy`` on rank 0 while rank 1 waits), in
the same launch, repeats interleaved, warm-up steps excluded, reported as ratios of medians. Every process runs one
thread, so the ideal ratio is 1/cp = 0.5 plus communication. This is a CPU/gloo figure on a small shared host: it
says nothing about GPU step time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common.launch import run_ranks
from lightning_dist.parallel.context_parallel.attention import (
    ALGORITHMS,
    LayerBytes,
    bytes_per_layer,
    context_parallel_attention,
    count_bytes_sent,
)
from lightning_dist.parallel.context_parallel.dispatch import shard_sequence

CP_SIZES = (1, 2, 4)
TIMED = ("context_parallel", "context_parallel_allgather", "context_parallel_ulysses", "one_process")  # last: baseline
TIMED_MODEL = {"vocab_size": 64, "seq_len": 512, "d_model": 128, "n_layer": 4, "n_head": 4}


@dataclass(frozen=True)
class Shape:
    """One attention layer: batch, global sequence length, query heads, key/value heads, head dim."""

    batch: int = 1
    seq_len: int = 1024
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32


def _layout(algorithm: str) -> str:
    return "contiguous" if algorithm == "ulysses" else "zigzag"


def _inputs(shape: Shape, seq_len: int, cp: int, rank: int, layout: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    full = [
        torch.randn(shape.batch, heads, seq_len, shape.head_dim, generator=g)
        for heads in (shape.heads, shape.kv_heads, shape.kv_heads)
    ]
    return [shard_sequence(t, cp, rank, layout, dim=2).requires_grad_() for t in full]


def saved_bytes(shape: Shape, seq_len: int, algorithm: str, group: dist.ProcessGroup) -> int:
    """Bytes this rank's autograd keeps from the layer's forward to its backward (distinct storages)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v = _inputs(shape, seq_len, cp, rank, _layout(algorithm))
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        context_parallel_attention(q, k, v, group, algorithm, _layout(algorithm), is_causal=True, enable_gqa=True)
    return sum(storages.values())


def sent_bytes(shape: Shape, algorithm: str, group: dist.ProcessGroup) -> tuple[int, int]:
    """``(forward, backward)`` bytes this rank sends for the layer (cp=1: nothing to send, nothing run)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1:
        return 0, 0
    q, k, v = _inputs(shape, shape.seq_len, cp, rank, _layout(algorithm))
    with count_bytes_sent() as forward:
        out = context_parallel_attention(q, k, v, group, algorithm, _layout(algorithm), is_causal=True, enable_gqa=True)
    with count_bytes_sent() as backward:
        out.sum().backward()
    return sum(forward.values()), sum(backward.values())


def longest_sequence(shape: Shape, budget: int, algorithm: str, group: dist.ProcessGroup) -> dict[str, int]:
    """The largest multiple of ``2·cp`` whose activation memory fits ``budget`` bytes on this rank, with the
    measured bytes at it and at the next multiple."""
    cp = dist.get_world_size(group)
    step = 2 * cp
    per_token = saved_bytes(shape, shape.seq_len, algorithm, group) / (shape.seq_len // cp)
    seq_len = int(budget // per_token) * cp // step * step
    while saved_bytes(shape, seq_len, algorithm, group) > budget:  # the estimate is exact when memory is linear
        seq_len -= step
    while saved_bytes(shape, seq_len + step, algorithm, group) <= budget:
        seq_len += step
    return {
        "seq_len": seq_len,
        "bytes": saved_bytes(shape, seq_len, algorithm, group),
        "next_bytes": saved_bytes(shape, seq_len + step, algorithm, group),
    }


def cp_groups(world_size: int) -> dict[int, dist.ProcessGroup]:
    """This rank's group for every cp size of :data:`CP_SIZES` dividing ``world_size`` (every rank calls
    ``new_group`` for every group, as torch requires)."""
    rank, groups = dist.get_rank(), {}
    for cp in CP_SIZES:
        if world_size % cp:
            continue
        for first in range(0, world_size, cp):
            group = dist.new_group(list(range(first, first + cp)))
            if first <= rank < first + cp:
                groups[cp] = group
    return groups


def measure(shape: Shape = Shape(), budget: int = 1 << 20) -> dict[str, Any]:
    """Every figure of the module docstring, on this rank, in an initialized process group of 4 (or 2) ranks."""
    groups = cp_groups(dist.get_world_size())
    rows = []
    for algorithm in ALGORITHMS:
        for cp, group in groups.items():
            if algorithm == "ulysses" and shape.kv_heads % cp:
                continue
            forward, backward = sent_bytes(shape, algorithm, group)
            formula = bytes_per_layer(algorithm, shape.batch, shape.seq_len, shape.heads, shape.kv_heads,
                                      shape.head_dim, cp, torch.float32) if cp > 1 else LayerBytes(0, 0)  # fmt: skip
            rows.append({
                "algorithm": algorithm,
                "cp": cp,
                "activation_bytes": saved_bytes(shape, shape.seq_len, algorithm, group),
                "sent_forward": forward,
                "sent_backward": backward,
                "formula_forward": formula.forward,
                "formula_backward": formula.backward,
                "longest": longest_sequence(shape, budget, algorithm, group),
            })  # fmt: skip
    return {"shape": asdict(shape), "budget": budget, "dtype": "float32", "rows": rows}


def to_markdown(result: dict[str, Any]) -> str:
    """The tables of :func:`measure`'s result."""
    s = Shape(**result["shape"])
    mib = result["budget"] / 2**20
    lines = [
        (
            f"One causal attention layer, fp32, B={s.batch}, H={s.heads}, G={s.kv_heads}, D={s.head_dim}; memory"
            f" and bytes at S={s.seq_len}; longest S within {mib:g} MiB of activations per rank. Counted, not timed."
        ),
        "",
        (
            "| algorithm | cp | activation bytes / rank | × cp=1 | longest S in budget | × cp=1"
            " | sent fwd (formula) | sent bwd (formula) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    first: dict[str, dict[str, Any]] = {}
    for row in result["rows"]:
        base = first.setdefault(row["algorithm"], row)
        lines.append(
            f"| {row['algorithm']} | {row['cp']} | {row['activation_bytes']:,} "
            f"| {row['activation_bytes'] / base['activation_bytes']:.3f} | {row['longest']['seq_len']:,} "
            f"| {row['longest']['seq_len'] / base['longest']['seq_len']:.2f} "
            f"| {row['sent_forward']:,} ({row['formula_forward']:,}) "
            f"| {row['sent_backward']:,} ({row['formula_backward']:,}) |"
        )
    return "\n".join(lines) + "\n"


def time_step(
    batch_size: int = 4, warmup: int = 2, steps: int = 5, repeats: int = 5, seq_len: int = TIMED_MODEL["seq_len"]
) -> dict[str, Any]:
    """Step times of every :data:`TIMED` configuration on this launch's 2 processes (an initialized process group),
    for a global batch of ``batch_size`` sequences of ``seq_len`` tokens; rank 0's result is whole."""
    model = {**TIMED_MODEL, "seq_len": seq_len}
    from benchmarks.studies.pipeline import load_average, time_fits
    from examples.data import TextDataModule
    from examples.gpt import GPT

    load_start = load_average()
    samples = batch_size * (warmup + steps)
    times = time_fits(
        {name: {"strategy": name, "batch_size": batch_size} for name in TIMED},  # cp keeps the whole batch per rank
        lambda: GPT(**model, lr=1e-3, warmup_steps=2),
        lambda b: TextDataModule(seq_len=seq_len, batch_size=b, train_samples=samples, seed=0),
        warmup,
        steps,
        repeats,
    )
    return {
        "times": times,
        "world": dist.get_world_size(),
        "load_start": load_start,
        "load_end": load_average(),
        "config": {"model": model, "global_batch": batch_size, "warmup": warmup, "steps": steps,
                   "repeats": repeats, "cpus": os.cpu_count(), "torch": torch.__version__},
    }  # fmt: skip


def time_markdown(result: dict[str, Any]) -> str:
    """The step-time table of :func:`time_step`'s result."""
    from benchmarks.studies.pipeline import ratio_table, time_header

    m, c = result["config"]["model"], result["config"]
    what = (
        f"the example GPT ({m['n_layer']} blocks, d_model {m['d_model']}, {m['n_head']} heads), global batch"
        f" {c['global_batch']} × {m['seq_len']} tokens; cp=2 (each rank {m['seq_len'] // 2} tokens of every"
        " sequence) against one process holding the whole sequence; ideal ratio 0.5"
    )
    return "\n".join(ratio_table(result["times"], TIMED[-1], time_header(result, what))) + "\n"


def _worker(out: str, timed: dict[str, int] | None = None) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    try:
        if timed is not None:
            torch.set_num_threads(1)
            result = time_step(**timed)
        else:
            result = measure()
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the tables (markdown) and the numbers (.json beside it) here")
    parser.add_argument("--no-time", action="store_true", help="only the counts, no step-time table")
    parser.add_argument("--batch-size", type=int, default=4, help="global batch of the step-time table")
    parser.add_argument("--seq-len", type=int, default=TIMED_MODEL["seq_len"], help="sequence length (step time)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--timed-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    timed = {
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
    }
    if args.worker:
        _worker(args.worker, timed if args.timed_worker else None)
        return
    result = _launch(4, [])
    table = to_markdown(result)
    if not args.no_time:
        options = ["--timed-worker", *(f"--{k.replace('_', '-')}={v}" for k, v in timed.items())]
        result["time"] = _launch(2, options)
        table += "\n" + time_markdown(result["time"])
    print(table)
    if args.out:
        Path(args.out).write_text(table)
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))


def _launch(nproc: int, options: list[str]) -> dict[str, Any]:
    """Run this module's worker on ``nproc`` CPU processes (one thread each) and return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp, "result.json")
        run_ranks([sys.executable, "-m", "benchmarks.context_parallel", "--worker", str(result_path), *options], nproc)
        return json.loads(result_path.read_text())


if __name__ == "__main__":
    main()
