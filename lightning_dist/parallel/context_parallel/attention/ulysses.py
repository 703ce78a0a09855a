"""Ulysses attention (DeepSpeed-Ulysses): an all-to-all turns sequence shards of all heads into the whole sequence
of ``H/cp`` heads, attention runs locally, and a second all-to-all turns the result back.

Needs the query heads and the key/value heads divisible by cp (key/value heads are never expanded before the
all-to-all). After the exchange the sequence is in shard order; a zigzag layout is put into global order around
the local attention so a causal mask is exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.parallel.context_parallel.attention.blocks import (
    accumulation_dtype,
    expand_kv_heads,
    sum_kv_head_grads,
)
from lightning_dist.parallel.context_parallel.attention.comm import all_to_all
from lightning_dist.parallel.context_parallel.attention.kernels import select_kernel
from lightning_dist.parallel.context_parallel.attention.layout import local_positions


class UlyssesHeadsError(ValueError):
    """Heads that cannot be split over the cp ranks."""


def check_heads(query_heads: int, kv_heads: int, cp: int) -> None:
    """Raise :class:`UlyssesHeadsError` unless both head counts divide by ``cp``."""
    if query_heads % cp or kv_heads % cp:
        raise UlyssesHeadsError(
            f"Ulysses context parallel splits attention heads over the cp ranks: query heads ({query_heads}) and"
            f" key/value heads ({kv_heads}) must both be divisible by cp={cp}. Use a cp that divides both, or the"
            " ring or allgather attention, which have no such constraint."
        )


def _sequence_to_heads(x: Tensor, group: Any) -> Tensor:
    """``[*lead, H, L, D]`` (all heads, local sequence) → ``[*lead, H/c, c·L, D]`` (local heads, whole sequence)."""
    cp = dist.get_world_size(group)
    *lead, heads, length, dim = x.shape
    by_destination = x.reshape(*lead, cp, heads // cp, length, dim).movedim(len(lead), 0)
    by_source = all_to_all(by_destination, group)  # [c, *lead, H/c, L, D]: slice i is rank i's sequence shard
    return by_source.movedim(0, len(lead) + 1).reshape(*lead, heads // cp, cp * length, dim)


def _heads_to_sequence(x: Tensor, group: Any) -> Tensor:
    """Inverse (and adjoint) of :func:`_sequence_to_heads`."""
    cp = dist.get_world_size(group)
    *lead, heads, seq, dim = x.shape
    by_destination = x.reshape(*lead, heads, cp, seq // cp, dim).movedim(len(lead) + 1, 0)
    by_source = all_to_all(by_destination, group)  # [c, *lead, H/c, L, D]: slice i holds rank i's heads
    return by_source.movedim(0, len(lead)).reshape(*lead, cp * heads, seq // cp, dim)


class _Exchange(torch.autograd.Function):
    """The all-to-all between sequence shards and head shards (``to_heads``) or back; backward is the other way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _sequence_to_heads(x, group) if to_heads else _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        back = _heads_to_sequence if ctx.to_heads else _sequence_to_heads
        return back(grad, ctx.group), None, None


class LocalAttention(torch.autograd.Function):
    """Attention of whole sequences on one rank with the block kernel of the device and dtype (GQA expanded here)."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: float) -> Tensor:
        kernel = select_kernel(query.device, query.dtype)
        groups = query.shape[-3] // key.shape[-3]
        out, lse = kernel.forward(query, expand_kv_heads(key, groups), expand_kv_heads(value, groups), causal, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        kernel = select_kernel(query.device, query.dtype)
        groups = query.shape[-3] // key.shape[-3]
        k_full, v_full = expand_kv_heads(key, groups), expand_kv_heads(value, groups)
        dq, dk, dv = kernel.backward(dout.contiguous(), query, k_full, v_full, out, lse, ctx.causal, ctx.scale)
        acc = accumulation_dtype(query.dtype)
        dk = sum_kv_head_grads(dk.to(acc), groups).to(key.dtype)
        dv = sum_kv_head_grads(dv.to(acc), groups).to(value.dtype)
        return dq, dk, dv, None, None


def _shard_order_positions(seq_len: int, cp: int, layout: str, device: torch.device) -> Tensor:
    """Global position of each token of the sequence as the all-to-all assembles it (rank 0's shard first)."""
    return torch.cat([local_positions(seq_len, cp, rank, layout, device) for rank in range(cp)])


def ulysses_attention(
    query: Tensor, key: Tensor, value: Tensor, group: Any, layout: str, causal: bool, scale: float
) -> Tensor:
    """Attention over the full sequence from the local shards ``[B, H, L, D]`` (key/value ``[B, G, L, D]``)."""
    cp = dist.get_world_size(group)
    check_heads(query.shape[-3], key.shape[-3], cp)
    q = _Exchange.apply(query, group, True)
    k, v = _Exchange.apply(torch.stack([key, value]), group, True).unbind(0)
    reorder = layout == "zigzag" and causal
    if reorder:
        positions = _shard_order_positions(q.shape[-2], cp, layout, q.device)
        to_global = torch.argsort(positions)
        q, k, v = (t.index_select(-2, to_global) for t in (q, k, v))
    out = LocalAttention.apply(q, k, v, causal, scale)
    if reorder:
        out = out.index_select(-2, positions)
    return _Exchange.apply(out, group, False)
