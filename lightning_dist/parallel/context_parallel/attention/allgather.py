"""All-gather key/value attention (as Llama 3 trained long context): every rank gathers the whole sequence's keys
and values (only the ``G`` key/value heads: cheap with GQA) and attends its local queries to them.

Backward gathers the keys and values again (the forward keeps only the local shards, so activation memory stays
``∝ 1/cp``) and reduce-scatters their gradients, summed in fp32 for low-precision inputs, back to their owners.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from lightning_dist.parallel.context_parallel.attention.blocks import (
    BlockTask,
    OnlineSoftmax,
    attend,
    attend_backward,
    backward_inputs,
    block_tasks,
    expand_kv_heads,
    save_for_backward,
)
from lightning_dist.parallel.context_parallel.attention.comm import all_gather, reduce_scatter
from lightning_dist.parallel.context_parallel.attention.kernels import shard_setting

# (q_rows, causal) → the key/value rows of each source rank that those queries see.
_Plan = dict[tuple[int, int, bool], list[tuple[int, slice]]]


def _plan(rank: int, cp: int, local_len: int, layout: str, causal: bool) -> _Plan:
    """The block tasks against every source, grouped so that each group is one kernel call on concatenated keys."""
    plan: _Plan = defaultdict(list)
    for source in range(cp):
        for task in block_tasks(rank, source, local_len, layout, causal):
            plan[(task.q_rows.start, task.q_rows.stop, task.causal)].append((source, task.kv_cols))
    return plan


def _joined(shards: list[Tensor], pieces: list[tuple[int, slice]]) -> Tensor:
    """The key/value rows ``pieces`` of the gathered ``[2, B, G, L, D]`` shards, concatenated along the sequence."""
    return torch.cat([shards[source][..., cols, :] for source, cols in pieces], dim=-2)


class AllGatherAttention(torch.autograd.Function):
    """``out = softmax(q·kᵀ·scale)·v`` over the full sequence from the local shards of ``q, k, v``."""

    @staticmethod
    def forward(
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, group: Any, layout: str, causal: bool, scale: float
    ) -> Tensor:
        cp, rank, kernel, groups = shard_setting(query, key, group)
        shards = all_gather(torch.stack([key, value]), group)
        acc = OnlineSoftmax(query)
        for (start, stop, causal_block), pieces in _plan(rank, cp, query.shape[-2], layout, causal).items():
            kv = _joined(shards, pieces)
            whole = slice(0, kv.shape[-2])
            task = BlockTask(slice(start, stop), whole, causal_block)
            attend(kernel, query, expand_kv_heads(kv[0], groups), expand_kv_heads(kv[1], groups), [task], scale, acc)
        out, lse = acc.result(query.dtype)
        save_for_backward(ctx, (query, key, value, out, lse), group, layout, causal, scale)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        b = backward_inputs(ctx, dout)
        group, cp, rank, groups, acc_dtype = ctx.group, b.cp, b.rank, b.groups, b.acc_dtype
        query, key, value, dq = b.query, b.key, b.value, b.dq
        shards = all_gather(torch.stack([key, value]), group)
        dshards = [torch.zeros(shard.shape, dtype=acc_dtype, device=shard.device) for shard in shards]
        for (start, stop, causal_block), pieces in _plan(rank, cp, query.shape[-2], ctx.layout, ctx.causal).items():
            kv = _joined(shards, pieces)
            dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=kv.device)
            task = BlockTask(slice(start, stop), slice(0, kv.shape[-2]), causal_block)
            k_full, v_full = expand_kv_heads(kv[0], groups), expand_kv_heads(kv[1], groups)
            attend_backward(b.kernel, b.rows, k_full, v_full, [task], ctx.scale, dq, dkv, groups)
            offset = 0
            for source, cols in pieces:
                length = cols.stop - cols.start
                dshards[source][..., cols, :] += dkv[..., offset : offset + length, :]
                offset += length
        dkv = reduce_scatter(dshards, group)
        return dq.to(query.dtype), dkv[0].to(key.dtype), dkv[1].to(value.dtype), None, None, None, None
