"""The computation of one rank's local experts on the rows dispatched to them (grouped by expert).

On CPU (and on GPUs or dtypes the grouped GEMM does not take) a loop of one matmul pair per expert; on CUDA with
bf16 weights on sm80+, two grouped GEMMs (``grouped_mm`` through :mod:`lightning_dist.compat`) cover all local
experts at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_dist.compat import grouped_mm


@dataclass
class StackedWeights:
    """One rank's slice of a layer's 3-D expert weights (transformers 5.x layout), local tensors.

    Attributes:
        gate_up: ``(E_local, 2I, H)``, or ``(E_local, H, 2I)`` when ``transposed``.
        down: ``(E_local, H, I)``, or ``(E_local, I, H)`` when ``transposed``.
        gate_up_bias / down_bias: ``(E_local, 2I)`` / ``(E_local, H)`` or ``None``.
        transposed: The weights are stored input-major (gpt-oss), so ``x @ w`` rather than ``x @ w.T``.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    transposed: bool = False


def run_local_experts(
    rows: torch.Tensor,
    tokens_per_expert: list[int],
    weights: StackedWeights,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``down(apply_gate(gate_up(x)))`` for each local expert on its rows; ``rows`` are grouped by local expert,
    ``tokens_per_expert[e]`` of them for expert ``e``. Returns the outputs in the same row order."""
    if rows.shape[0] == 0:
        return _no_rows(rows, weights)
    if grouped_gemm_ok(rows, weights):
        return run_grouped_gemm(rows, tokens_per_expert, weights, apply_gate)
    return run_per_expert_loop(rows, tokens_per_expert, weights, apply_gate)


def run_per_expert_loop(
    rows: torch.Tensor,
    tokens_per_expert: list[int],
    weights: StackedWeights,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """:func:`run_local_experts` as one matmul pair per expert that received rows (any device and dtype)."""
    outputs = []
    start = 0
    for e, count in enumerate(tokens_per_expert):
        if count == 0:
            continue
        x = rows[start : start + count]
        start += count
        h = _project(x, weights.gate_up[e], weights.gate_up_bias, e, weights.transposed)
        outputs.append(_project(apply_gate(h), weights.down[e], weights.down_bias, e, weights.transposed))
    if not outputs:
        return _no_rows(rows, weights)
    return torch.cat(outputs)


def _no_rows(rows: torch.Tensor, weights: StackedWeights) -> torch.Tensor:
    """The empty result when no token reached this rank's experts. It still joins the autograd graph, through the
    weights (their replica all-reduce) and through the rows, so that the dispatch all-to-all's backward runs here as
    it does on the other ep ranks (without it they wait for this rank forever)."""
    touch = sum(
        w.sum() for w in (weights.gate_up, weights.down, weights.gate_up_bias, weights.down_bias) if w is not None
    )
    return rows.new_zeros((0, weights.down.shape[2 if weights.transposed else 1])) + 0 * (touch + rows.sum())


def _project(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, e: int, transposed: bool) -> torch.Tensor:
    b = None if bias is None else bias[e]
    if transposed:
        out = x @ w
        return out if b is None else out + b
    return F.linear(x, w, b)


def grouped_gemm_ok(rows: torch.Tensor, weights: StackedWeights) -> bool:
    """Grouped GEMM where torch's kernel takes it (CUDA, bf16, compute capability 8.0+) and it pays: with one local
    expert the plain matmuls were as fast (0.95× on an H200, docs/expert_parallel.md)."""
    return (
        rows.is_cuda
        and rows.dtype == torch.bfloat16
        and weights.gate_up.dtype == torch.bfloat16
        and weights.gate_up.shape[0] > 1
        and torch.cuda.get_device_capability(rows.device) >= (8, 0)
    )


def run_grouped_gemm(
    rows: torch.Tensor,
    tokens_per_expert: list[int],
    weights: StackedWeights,
    apply_gate: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """:func:`run_local_experts` as two grouped GEMMs over all local experts (CUDA, bf16, sm80+)."""
    offs = torch.tensor(tokens_per_expert, device=rows.device).cumsum(0).to(torch.int32)
    gate_up = weights.gate_up if weights.transposed else weights.gate_up.transpose(-2, -1)
    down = weights.down if weights.transposed else weights.down.transpose(-2, -1)
    h = grouped_mm(rows, gate_up, offs)
    if weights.gate_up_bias is not None:
        h = _AddExpertBias.apply(h, weights.gate_up_bias, tokens_per_expert)
    out = grouped_mm(apply_gate(h), down, offs)
    if weights.down_bias is not None:
        out = _AddExpertBias.apply(out, weights.down_bias, tokens_per_expert)
    return out


class _AddExpertBias(torch.autograd.Function):
    """``rows + bias[e]`` for each expert's block of rows. The bias gradient sums each block in fp32 as the per-expert
    loop's does: autograd's ``repeat_interleave`` backward accumulates in bf16 (0.02 relative error on an H200 against
    the loop's 0.0015)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, bias: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        ctx.tokens_per_expert = tokens_per_expert
        counts = torch.tensor(tokens_per_expert, device=bias.device)
        return rows + torch.repeat_interleave(bias, counts, dim=0, output_size=rows.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        blocks = grad.split(ctx.tokens_per_expert)
        bias_grad = torch.stack([block.sum(0, dtype=torch.float32) for block in blocks]).to(grad.dtype)
        return grad, bias_grad, None
