"""Ring (pass-KV) attention: each rank keeps its queries; key/value shards travel once around the cp group.

Forward: at step ``i`` rank ``r`` holds the key/value shard of rank ``r−i``; the transfer of the next shard is
started before the current one is used, so communication overlaps compute. Partial results are merged with the
online softmax. Backward: key/value shards travel again, together with a gradient accumulator for each shard that
every rank adds its share to; after ``c`` hops the accumulator is back at the shard's owner.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dist.parallel.context_parallel.attention.blocks import (
    OnlineSoftmax,
    attend,
    attend_backward,
    backward_inputs,
    block_tasks,
    expand_kv_heads,
    save_for_backward,
)
from lightning_dist.parallel.context_parallel.attention.comm import RingShift
from lightning_dist.parallel.context_parallel.attention.kernels import shard_setting

_KV_TAG = 11
_DKV_TAG = 12


class RingAttention(torch.autograd.Function):
    """``out = softmax(q·kᵀ·scale)·v`` over the full sequence from the local shards of ``q, k, v``."""

    @staticmethod
    def forward(
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, group: Any, layout: str, causal: bool, scale: float
    ) -> Tensor:
        cp, rank, kernel, groups = shard_setting(query, key, group)
        acc = OnlineSoftmax(query)
        kv = torch.stack([key, value])
        for step in range(cp):
            shift = RingShift(kv, group, _KV_TAG) if step < cp - 1 else None
            tasks = block_tasks(rank, (rank - step) % cp, query.shape[-2], layout, causal)
            attend(kernel, query, expand_kv_heads(kv[0], groups), expand_kv_heads(kv[1], groups), tasks, scale, acc)
            if shift is not None:
                kv = shift.wait()
        out, lse = acc.result(query.dtype)
        save_for_backward(ctx, (query, key, value, out, lse), group, layout, causal, scale)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        b = backward_inputs(ctx, dout)
        group, cp, rank, groups, acc_dtype = ctx.group, b.cp, b.rank, b.groups, b.acc_dtype
        query, key, value, dq = b.query, b.key, b.value, b.dq
        kv = torch.stack([key, value])
        incoming_dkv: RingShift | None = None
        for step in range(cp):
            kv_shift = RingShift(kv, group, _KV_TAG) if step < cp - 1 else None
            tasks = block_tasks(rank, (rank - step) % cp, query.shape[-2], ctx.layout, ctx.causal)
            dkv = torch.zeros(kv.shape, dtype=acc_dtype, device=kv.device)
            k_full, v_full = expand_kv_heads(kv[0], groups), expand_kv_heads(kv[1], groups)
            attend_backward(b.kernel, b.rows, k_full, v_full, tasks, ctx.scale, dq, dkv, groups)
            if incoming_dkv is not None:  # the accumulator of this shard, from the ranks that held it before
                dkv += incoming_dkv.wait()
            incoming_dkv = RingShift(dkv, group, _DKV_TAG)
            if kv_shift is not None:
                kv = kv_shift.wait()
        dkv = incoming_dkv.wait()  # type: ignore[union-attr]  # after c hops: our own shard's gradient
        return dq.to(query.dtype), dkv[0].to(key.dtype), dkv[1].to(value.dtype), None, None, None, None
