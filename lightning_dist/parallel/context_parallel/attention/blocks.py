"""The pieces ring and all-gather attention share: which part of a key/value block each query block attends to,
the online-softmax merge of partial results, and grouped-query (GQA) head expansion.

Tensors are ``[B, H, L, D]`` with ``L`` the local sequence length; key/value blocks come from one cp rank each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.parallel.context_parallel.attention.kernels import BlockKernel, select_kernel


@dataclass(frozen=True)
class BlockTask:
    """Local query rows ``q_rows`` attend to rows ``kv_cols`` of a key/value block, causally (top-left) or fully."""

    q_rows: slice
    kv_cols: slice
    causal: bool


def block_tasks(rank: int, source: int, local_len: int, layout: str, causal: bool) -> list[BlockTask]:
    """What rank ``rank``'s queries compute against the key/value shard of rank ``source`` (both in ``layout``).

    Zigzag: rank ``r`` holds chunks ``r`` and ``2c−1−r``. For ``source < r`` every query sees only the first chunk of
    the source (its second chunk lies after both of ours); for ``source > r`` only our second chunk sees the source,
    and all of it. On the diagonal the local order is the global order, so a plain causal mask is exact.
    """
    whole = slice(0, local_len)
    if not causal:
        return [BlockTask(whole, whole, False)]
    if source == rank:
        return [BlockTask(whole, whole, True)]
    if layout == "contiguous":
        return [BlockTask(whole, whole, False)] if source < rank else []
    half = local_len // 2
    if source < rank:
        return [BlockTask(whole, slice(0, half), False)]
    return [BlockTask(slice(half, local_len), whole, False)]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial outputs and gradients are summed in fp32 (fp64 for fp64 inputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def expand_kv_heads(x: Tensor, groups: int) -> Tensor:
    """``[B, G, L, D]`` → ``[B, G·groups, L, D]``: each key/value head serves ``groups`` consecutive query heads."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def sum_kv_head_grads(dx: Tensor, groups: int) -> Tensor:
    """Adjoint of :func:`expand_kv_heads`: the gradient of each key/value head is the sum over its query heads."""
    if groups == 1:
        return dx
    *lead, heads, length, dim = dx.shape
    return dx.reshape(*lead, heads // groups, groups, length, dim).sum(dim=-3)


class OnlineSoftmax:
    """Merges partial attention results ``(out_b, lse_b)`` over disjoint key sets into the exact result.

    ``lse' = logaddexp(lse, lse_b)``, ``out' = out·e^{lse−lse'} + out_b·e^{lse_b−lse'}``, kept in
    :func:`accumulation_dtype`.
    """

    def __init__(self, query: Tensor) -> None:
        acc = accumulation_dtype(query.dtype)
        self.out = torch.zeros(query.shape, dtype=acc, device=query.device)
        self.lse = torch.full(query.shape[:-1], float("-inf"), dtype=acc, device=query.device)

    def add(self, rows: slice, out_b: Tensor, lse_b: Tensor) -> None:
        old_out, old_lse = self.out[..., rows, :], self.lse[..., rows]
        lse_b = lse_b.to(old_lse.dtype)
        new_lse = torch.logaddexp(old_lse, lse_b)
        merged = old_out * torch.exp(old_lse - new_lse).unsqueeze(-1) + out_b.to(old_out.dtype) * torch.exp(
            lse_b - new_lse
        ).unsqueeze(-1)
        self.out[..., rows, :] = merged
        self.lse[..., rows] = new_lse

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The merged output in ``dtype`` and the row log-sum-exp (fp32, fp64 for fp64 inputs)."""
        return self.out.to(dtype), self.lse


def attend(
    kernel: BlockKernel,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    tasks: list[BlockTask],
    scale: float,
    acc: OnlineSoftmax,
) -> None:
    """Add what ``query`` gets from one key/value block (heads already expanded) to ``acc``."""
    for task in tasks:
        out_b, lse_b = kernel.forward(
            query[..., task.q_rows, :], key[..., task.kv_cols, :], value[..., task.kv_cols, :], task.causal, scale
        )
        acc.add(task.q_rows, out_b, lse_b)


@dataclass(frozen=True)
class QueryRows:
    """What the backward of every key/value block needs about the local queries: the queries, the gradient of the
    output, and the final (merged) output and log-sum-exp."""

    query: Tensor
    dout: Tensor
    out: Tensor
    lse: Tensor


def attend_backward(
    kernel: BlockKernel,
    rows: QueryRows,
    key: Tensor,
    value: Tensor,
    tasks: list[BlockTask],
    scale: float,
    dq: Tensor,
    dkv: Tensor,
    groups: int,
) -> None:
    """Add one key/value block's share of the gradients to ``dq`` and to ``dkv`` (``[2, B, G, Lk, D]``); ``key``
    and ``value`` have their heads expanded, ``groups`` query heads per key/value head."""
    for task in tasks:
        q_rows, cols = task.q_rows, task.kv_cols
        dq_b, dk_b, dv_b = kernel.backward(
            rows.dout[..., q_rows, :],
            rows.query[..., q_rows, :],
            key[..., cols, :],
            value[..., cols, :],
            rows.out[..., q_rows, :],
            rows.lse[..., q_rows],
            task.causal,
            scale,
        )
        dq[..., q_rows, :] += dq_b
        dkv[0, ..., cols, :] += sum_kv_head_grads(dk_b, groups)
        dkv[1, ..., cols, :] += sum_kv_head_grads(dv_b, groups)


# Saved with every context-parallel attention's tensors: activation-checkpoint recompute through plain SDPA then saves
# a different number of tensors and fails loudly instead of giving wrong gradients.
_RECOMPUTE_MARKER = torch.empty(0, dtype=torch.int8)


def save_for_backward(
    ctx: Any, tensors: tuple[Tensor, ...], group: Any, layout: str, causal: bool, scale: float
) -> None:
    """Keep ``(query, key, value, out, lse)`` and the options of a sharded attention forward for its backward."""
    ctx.save_for_backward(_RECOMPUTE_MARKER, *tensors)
    ctx.group, ctx.layout, ctx.causal, ctx.scale = group, layout, causal, scale


@dataclass
class BackwardInputs:
    """What the backward of a sharded attention starts from (see :func:`backward_inputs`)."""

    query: Tensor
    key: Tensor
    value: Tensor
    rows: QueryRows
    cp: int
    rank: int
    kernel: Any
    groups: int  # query heads per key/value head
    acc_dtype: torch.dtype
    dq: Tensor  # the query gradient accumulator


def backward_inputs(ctx: Any, dout: Tensor) -> BackwardInputs:
    """Unpack what :func:`save_for_backward` kept and set up the query-gradient accumulator."""
    _, query, key, value, out, lse = ctx.saved_tensors
    acc_dtype = accumulation_dtype(query.dtype)
    return BackwardInputs(
        query=query,
        key=key,
        value=value,
        rows=QueryRows(query, dout.contiguous(), out, lse),
        cp=dist.get_world_size(ctx.group),
        rank=dist.get_rank(ctx.group),
        kernel=select_kernel(query.device, query.dtype),
        groups=query.shape[-3] // key.shape[-3],
        acc_dtype=acc_dtype,
        dq=torch.zeros(query.shape, dtype=acc_dtype, device=query.device),
    )
