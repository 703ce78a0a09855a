"""Block attention kernels: one query block against one key/value block.

Every kernel has the same two functions:

* ``forward(q, k, v, causal, scale) -> (out, lse)`` with ``q: [B, H, Sq, D]``, ``k, v: [B, H, Sk, D]`` (heads already
  matched), ``out: [B, H, Sq, D]`` and the row log-sum-exp ``lse: [B, H, Sq]`` (fp32, fp64 for fp64 inputs);
  ``causal`` masks top-left aligned (only used on square diagonal blocks).
* ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` given the *final* output and log-sum-exp of
  the rows (merged over every block): then the block's gradients are its exact share of the full attention's.

Choice (:func:`select_kernel`): explicit matmuls for fp64 (exact enough for 1e-10 tests), the CPU flash kernel on CPU,
and on CUDA the flash kernel (fp16/bf16) or the memory-efficient kernel (fp32).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.compat import aten_attention_op

ForwardFn = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
BackwardFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class BlockKernel:
    """A named pair of block forward and backward functions (see the module docstring)."""

    name: str
    forward: ForwardFn
    backward: BackwardFn


# ---------------------------------------------------------------------------------------------------- explicit matmuls
def _masked_scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        above_diagonal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(above_diagonal, float("-inf"))
    return scores


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    scores = _masked_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    probs = torch.exp(_masked_scores(q, k, causal, scale) - lse.unsqueeze(-1).to(q.dtype))
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    row_dot = (dout * out).sum(dim=-1, keepdim=True)
    dscores = probs * (torch.matmul(dout, v.transpose(-2, -1)) - row_dot)
    return torch.matmul(dscores, k) * scale, torch.matmul(dscores.transpose(-2, -1), q) * scale, dv


MATH = BlockKernel("math", _math_forward, _math_backward)


# ---------------------------------------------------------------------------------------------------- CPU flash
def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = aten_attention_op("_scaled_dot_product_flash_attention_for_cpu")(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def _cpu_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    op = aten_attention_op("_scaled_dot_product_flash_attention_for_cpu_backward")
    return op(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


CPU_FLASH = BlockKernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward)


# ---------------------------------------------------------------------------------------------------- CUDA
# Not exercised by the CPU test suite. With dropout 0 the kernels never read their random-number state.
def _no_rng_state(device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.int64, device=device)


def _cuda_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, *_ = aten_attention_op("_scaled_dot_product_flash_attention")(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _cuda_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    op = aten_attention_op("_scaled_dot_product_flash_attention_backward")
    no_cum = torch.empty(0, dtype=torch.int32, device=q.device)
    rng = _no_rng_state(q.device)
    sq, sk = q.shape[-2], k.shape[-2]
    return op(dout, q, k, v, out, lse, no_cum, no_cum, sq, sk, 0.0, causal, rng, rng, scale=scale)


_EFFICIENT_LSE_ALIGNMENT = 32  # the memory-efficient kernel pads its log-sum-exp rows to a multiple of this


def _cuda_efficient_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    op = aten_attention_op("_scaled_dot_product_efficient_attention")
    out, lse, *_ = op(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[-2]]


def _cuda_efficient_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    op = aten_attention_op("_scaled_dot_product_efficient_attention_backward")
    padded = math.ceil(lse.shape[-1] / _EFFICIENT_LSE_ALIGNMENT) * _EFFICIENT_LSE_ALIGNMENT
    lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1]))
    rng = _no_rng_state(q.device)
    dq, dk, dv, _ = op(dout, q, k, v, None, out, lse, rng, rng, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


CUDA_FLASH = BlockKernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)
CUDA_EFFICIENT = BlockKernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward)


def select_kernel(device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The block kernel for tensors on ``device`` of ``dtype``."""
    if dtype == torch.float64:
        return MATH
    if device.type == "cpu":
        return CPU_FLASH
    if device.type == "cuda":
        return CUDA_FLASH if dtype in (torch.float16, torch.bfloat16) else CUDA_EFFICIENT
    return MATH


def shard_setting(query: Tensor, key: Tensor, group: Any) -> tuple[int, int, BlockKernel, int]:
    """For local shards ``query: [B, H, L, D]``, ``key: [B, G, L, D]``: the cp group's size, this rank in it, the
    block kernel of the device and dtype, and the query heads per key/value head (``H / G``)."""
    kernel = select_kernel(query.device, query.dtype)
    return dist.get_world_size(group), dist.get_rank(group), kernel, query.shape[-3] // key.shape[-3]
