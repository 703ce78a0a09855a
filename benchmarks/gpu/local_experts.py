"""One GPU: expert parallel's two ways of running a rank's local experts, side by side, forward + backward, bf16.

    python -m benchmarks.gpu_local_experts                 # CUDA; results in benchmarks/results/gpu/
    python -m benchmarks.gpu_local_experts --device cpu --shapes toy --iters 2     # a CPU smoke run

* ``loop``: one matmul pair per expert (:func:`~lightning_dist.parallel.expert_parallel.local_experts.run_per_expert_loop`,
  what CPUs and older GPUs get);
* ``grouped``: two grouped GEMMs over all local experts
  (:func:`~lightning_dist.parallel.expert_parallel.local_experts.run_grouped_gemm`, what CUDA bf16 sm80+ gets).

Each shape is one MoE layer's experts on one rank of an ep mesh: ``experts`` local experts (the model's experts / ep)
and the rows the all-to-all brings them (tokens per rank × top_k, routed uniformly at random, so counts differ). Time
is the median of ``iters`` CUDA-event timings after ``warmup`` untimed ones; TFLOP/s counts 3 × 6 · rows · H · I
(gate_up and down, forward and the two backward matmuls). ``loop / grouped`` is the speedup of the grouped GEMM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lightning_dist.parallel.expert_parallel.local_experts import (
    StackedWeights,
    run_grouped_gemm,
    run_per_expert_loop,
)


@dataclass(frozen=True)
class ExpertsShape:
    """One rank's share of an MoE layer: ``experts`` local experts of hidden ``hidden``, inner ``inner``."""

    name: str
    experts: int
    hidden: int
    inner: int
    rows: int  # tokens per rank × top_k


SHAPES: dict[str, ExpertsShape] = {
    "toy": ExpertsShape("toy", 4, 64, 96, 256),
    # benchmarks/gpu/moe.py's "small" Mixtral at ep2: 8 experts / 2, batch 4 × seq 1024 × top-2
    "mixtral_small_ep2": ExpertsShape("mixtral_small_ep2", 4, 1024, 2816, 8192),
    # Mixtral-8x7B's layer at ep8 (one expert per rank), 8192 tokens × top-2
    "mixtral_8x7b_ep8": ExpertsShape("mixtral_8x7b_ep8", 1, 4096, 14336, 16384),
    # Mixtral-8x7B's layer at ep2
    "mixtral_8x7b_ep2": ExpertsShape("mixtral_8x7b_ep2", 4, 4096, 14336, 16384),
    # Qwen3-30B-A3B's layer (128 experts, top-8, hidden 2048, inner 768) at ep8: 16 local experts, 4096 tokens × top-8
    "qwen3_30b_a3b_ep8": ExpertsShape("qwen3_30b_a3b_ep8", 16, 2048, 768, 32768),
}
METHODS = {"loop": run_per_expert_loop, "grouped": run_grouped_gemm}


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def make_case(shape: ExpertsShape, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[int], StackedWeights]:
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(shape.experts, (shape.rows,), generator=g), minlength=shape.experts).tolist()
    gate_up = torch.randn(shape.experts, 2 * shape.inner, shape.hidden, generator=g) / shape.hidden**0.5
    down = torch.randn(shape.experts, shape.hidden, shape.inner, generator=g) / shape.inner**0.5
    weights = StackedWeights(*(w.to(device, dtype).requires_grad_() for w in (gate_up, down)))
    rows = torch.randn(shape.rows, shape.hidden, generator=g).to(device, dtype).requires_grad_()
    return rows, counts, weights


def time_method(method: str, shape: ExpertsShape, device: str, warmup: int, iters: int) -> dict[str, Any]:
    rows, counts, weights = make_case(shape, device, torch.bfloat16)
    fn = METHODS[method]
    grad = torch.randn(shape.rows, shape.hidden, device=device, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        out = fn(rows, counts, weights, _swiglu)
        out.backward(grad)
        return out.detach()

    times = []
    for i in range(warmup + iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            step()
            elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
    seconds = statistics.median(times)
    flops = 3 * 6 * shape.rows * shape.hidden * shape.inner
    return {"method": method, "seconds": seconds, "tflops": flops / seconds / 1e12}


def max_relative_difference(shape: ExpertsShape, device: str) -> float:
    """Largest |grouped − loop| / max |loop| over the output and every gradient (bf16 both)."""
    values = {}
    for method, fn in METHODS.items():
        rows, counts, weights = make_case(shape, device, torch.bfloat16)
        out = fn(rows, counts, weights, _swiglu)
        out.float().square().sum().backward()
        values[method] = [out.detach(), rows.grad, weights.gate_up.grad, weights.down.grad]
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        for a, b in zip(values["grouped"], values["loop"])
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_local_experts", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/gpu")
    p.add_argument(
        "--shapes", default=",".join(s for s in SHAPES if s != "toy"), help=f"comma-separated of {list(SHAPES)}"
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu_local_experts needs a CUDA GPU; `--device cpu --shapes toy` is a smoke run.")
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        timed = {m: time_method(m, shape, args.device, args.warmup, args.iters) for m in METHODS}
        rows.append(
            {
                **asdict(shape),
                **{f"{m}_ms": t["seconds"] * 1e3 for m, t in timed.items()},
                **{f"{m}_tflops": t["tflops"] for m, t in timed.items()},
                "loop_over_grouped": timed["loop"]["seconds"] / timed["grouped"]["seconds"],
                "max_relative_difference": max_relative_difference(shape, args.device),
            }
        )
        if args.device == "cuda":
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"device": device_name, "torch": torch.__version__, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_local_experts.json").write_text(json.dumps(result, indent=2))
    table = to_markdown(result)
    (out / "gpu_local_experts.md").write_text(table)
    print(table)
    return 0


def to_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Local experts, forward + backward, bf16, {result['device']} (torch {result['torch']})",
        "",
        (
            "| shape | local experts | hidden | inner | rows | loop ms | grouped ms | loop TFLOP/s | grouped TFLOP/s"
            " | loop / grouped | max rel. diff |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['name']} | {r['experts']} | {r['hidden']} | {r['inner']} | {r['rows']} | {r['loop_ms']:.3f}"
            f" | {r['grouped_ms']:.3f} | {r['loop_tflops']:.1f} | {r['grouped_tflops']:.1f}"
            f" | {r['loop_over_grouped']:.2f}× | {r['max_relative_difference']:.1e} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
