"""What ZeRO++'s quantization costs in kernels per training step, eager against ``torch.compile``d, on this machine.

    python -m benchmarks.zeropp_quantization                      # d_model 1024, 8 blocks, 8 ranks, 5 repeats
    python -m benchmarks.zeropp_quantization --d-model 2048 --ranks 16

The quantize and dequantize calls one rank makes in one step of a GPT-shaped model under ``zeropp`` on one node
(hpZ off): per FSDP2 unit (each block, then the root's embedding and head), the qwZ all-gather in forward and again in
backward (int8: pack this rank's shard, unpack every rank's) and the qgZ reduce-scatter (int4: pack the unit's
gradient in one row per rank, unpack the rows received and sum them in fp32). No communication: the bytes a rank
receives are its own sent bytes repeated, so only the kernels are timed. Printed: the median per step of each, the
compiled path's first-call compile time, and the wire bytes of both paths (equal: the same bytes are sent).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from lightning_dist.parallel.quantization import pack, unpack


def unit_sizes(d_model: int, n_layer: int, vocab: int = 32000) -> list[int]:
    """Parameters of each FSDP2 unit of a GPT block stack (attention 4·d², MLP 8·d², norms) and of the root
    (embedding and untied head)."""
    block = 12 * d_model * d_model + 13 * d_model
    return [block] * n_layer + [2 * vocab * d_model + 2 * d_model]


def step_inputs(sizes: list[int], ranks: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per unit: this rank's bf16 weight shard ``[1, shard]`` and the fp32 gradient rows ``[ranks, shard]``, on
    ``device``."""
    generator = torch.Generator().manual_seed(0)
    inputs = []
    for numel in sizes:
        shard = -(-numel // ranks)
        weights = torch.randn(1, shard, generator=generator).to(device, torch.bfloat16)
        inputs.append((weights, torch.randn(ranks, shard, generator=generator).to(device)))
    return inputs


def one_step(inputs: list[tuple[torch.Tensor, torch.Tensor]], ranks: int, compiled: bool) -> int:
    """The quantization work of one step on one rank; returns the wire bytes it produced."""
    sent = 0
    for weights, grads in inputs:
        shard = weights.shape[1]
        for _ in range(2):  # qwZ: forward, then backward's re-gather
            wire = pack(weights, 8, 256, compiled=compiled)
            unpack(wire.expand(ranks, -1), shard, 8, 256, torch.bfloat16, compiled=compiled)
            sent += wire.numel()
        wire = pack(grads, 4, 256, compiled=compiled)  # qgZ, one hop (one node)
        unpack(wire, shard, 4, 256, torch.float32, compiled=compiled).sum(dim=0)
        sent += wire.numel()
    return sent


def measure(
    d_model: int = 1024, n_layer: int = 8, ranks: int = 8, repeats: int = 5, device: str = "cpu"
) -> dict[str, Any]:
    sizes = unit_sizes(d_model, n_layer)
    inputs = step_inputs(sizes, ranks, device)

    def timed(compiled: bool) -> tuple[float, int]:
        if device == "cuda":  # kernels run asynchronously: time them to the end
            torch.cuda.synchronize()
        start = time.perf_counter()
        sent = one_step(inputs, ranks, compiled=compiled)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, sent

    compile_s, _ = timed(compiled=True)  # compiles (dynamic shapes: once for every size)
    timed(compiled=False)  # eager's first call pays its own warm-up (CUDA context, kernel loading)
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    sent: dict[str, int] = {}
    for _ in range(repeats):
        for name, seconds in times.items():  # interleaved
            elapsed, sent[name] = timed(compiled=name == "compiled")
            seconds.append(elapsed)
    eager, compiled = (statistics.median(times[k]) for k in ("eager", "compiled"))
    return {
        "device": device, "d_model": d_model, "n_layer": n_layer, "ranks": ranks, "parameters": sum(sizes), "eager_s": round(eager, 4),
        "compiled_s": round(compiled, 4), "speedup": round(eager / compiled, 2), "first_compile_s": round(compile_s, 1),
        "wire_bytes_eager": sent["eager"], "wire_bytes_compiled": sent["compiled"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the kernels run (default: cuda when a GPU is visible)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    r = measure(args.d_model, args.layers, args.ranks, args.repeats, args.device)
    where = "CUDA" if args.device == "cuda" else "CPU"
    print(
        f"| {r['parameters'] / 1e6:.0f}M parameters over {r['ranks']} ranks, one step on {where} | eager | compiled |"
    )
    print("|---|---|---|")
    print(f"| quantize + dequantize per step | {r['eager_s']:.4f} s | {r['compiled_s']:.4f} s ({r['speedup']}x) |")
    print(f"| wire bytes per step | {r['wire_bytes_eager']:,} | {r['wire_bytes_compiled']:,} |")
    print(f"| first call (compiles) | | {r['first_compile_s']} s |")
    return 0
