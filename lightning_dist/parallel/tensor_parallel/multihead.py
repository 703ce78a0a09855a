"""Tensor parallelism for ``nn.MultiheadAttention``: its heads are split over the tp ranks.

``in_proj_weight``/``in_proj_bias`` (``[Q | K | V]``) are permuted into rank order and sharded by heads, ``out_proj``
is sharded row-wise, ``num_heads``/``embed_dim`` become the per-rank values, and the module's class becomes
:class:`TensorParallelMultiheadAttention`, whose forward computes this rank's heads and sums the output projection
over the ranks. ``torch.nn.functional.multi_head_attention_forward`` cannot run on a shard: it takes the head width
from the input's (whole) embedding dim. Parameter names and the checkpoint layout do not change.

Under sequence parallel (``sequence_dim`` given) the inputs arrive as this rank's slice of the sequence: they are
all-gathered on entry (backward: reduce-scatter), and the output projection's partial sums are reduce-scattered back
to the slice (backward: all-gather) instead of all-reduced; the output bias then gets a partial gradient, summed over
tp before the optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_dist.parallel.fused_layouts import FusedLayout, rank_grouped_order
from lightning_dist.parallel.tensor_parallel.checkpoint_layout import record_row_order


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (each rank saw only its heads)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverRanks(torch.autograd.Function):
    """Forward sums the partial outputs over the group; backward passes the (whole) gradient to every rank."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the sequence slices on ``dim``. Backward: reduce-scatter (each rank's slice, summed)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Forward: sum the partial outputs over the group, keep this rank's sequence slice. Backward: all-gather."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        parts = [
            torch.empty_like(grad, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(ctx.group))
        ]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None


def _reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    chunks = [c.contiguous() for c in x.chunk(dist.get_world_size(group), dim=dim)]
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter(out, chunks, group=group)
    return out


class MultiheadAttentionParallel(ParallelStyle):
    """Shard an ``nn.MultiheadAttention`` by heads (see the module docstring).

    Args:
        sequence_dim: Under sequence parallel, the dim of the (batched) inputs and output that holds the sequence
            (1 with ``batch_first``, else 0); ``None`` without sequence parallel.
    """

    def __init__(self, sequence_dim: int | None = None) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.MultiheadAttention) or module.in_proj_weight is None:
            raise TypeError("MultiheadAttentionParallel shards nn.MultiheadAttention with one in_proj_weight")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("nn.MultiheadAttention with add_bias_kv or add_zero_attn is not sharded by heads")
        tp = device_mesh.size()
        heads = module.num_heads
        order = rank_grouped_order(FusedLayout("blocks", heads, heads, module.head_dim), tp)
        with torch.no_grad():
            for pname in ("in_proj_weight", "in_proj_bias"):
                param = getattr(module, pname)
                if param is not None:
                    permuted = param.index_select(0, order.to(param.device))
                    _register(module, pname, permuted, param.requires_grad, device_mesh, Shard(0))
                    record_row_order(module, pname, 0, order)
            out = module.out_proj
            _register(out, "weight", out.weight, out.weight.requires_grad, device_mesh, Shard(1))
            if out.bias is not None:
                _register(out, "bias", out.bias, out.bias.requires_grad, device_mesh, Replicate())
        module.__class__ = TensorParallelMultiheadAttention
        module.tp_group = device_mesh.get_group()
        module.sequence_dim = self.sequence_dim
        return module


def _register(module: nn.Module, pname: str, value: Tensor, grad: bool, mesh: DeviceMesh, placement: Any) -> None:
    dvalue = distribute_tensor(value, mesh, [placement])
    module.register_parameter(pname, nn.Parameter(dvalue, requires_grad=grad))


class TensorParallelMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` holding this rank's heads; inputs and output are whole (replicated) tensors."""

    tp_group: dist.ProcessGroup
    sequence_dim: int | None = None

    def forward(  # type: ignore[override]
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Same arguments and results as ``nn.MultiheadAttention.forward`` (self- or cross-attention)."""
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention does)")
        batched = query.dim() == 3
        same_key, same_value = key is query, value is key
        seq_dim = self.sequence_dim
        if seq_dim is not None:  # sequence parallel: whole sequences from here on
            if not batched:
                raise ValueError("sequence-parallel nn.MultiheadAttention takes batched (3-D) inputs")
            query = _GatherSequence.apply(query, seq_dim, self.tp_group)
            key = query if same_key else _GatherSequence.apply(key, seq_dim, self.tp_group)
            value = key if same_value else _GatherSequence.apply(value, seq_dim, self.tp_group)
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        if self.batch_first and batched:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        # (L, B, E) from here on, as in torch's implementation. Each input enters once: its gradient is summed
        # over the ranks (every rank used it for its own heads).
        x_q = self._to_ranks(query)
        x_k = x_q if same_key else self._to_ranks(key)
        x_v = x_k if same_value else self._to_ranks(value)
        weight, bias = _local(self.in_proj_weight), _local(self.in_proj_bias)
        w_q, w_k, w_v = weight.chunk(3)
        b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
        q, k, v = F.linear(x_q, w_q, b_q), F.linear(x_k, w_k, b_k), F.linear(x_v, w_v, b_v)
        length, batch = q.shape[0], q.shape[1]
        heads, head_dim = self.num_heads, self.head_dim
        q, k, v = (t.reshape(t.shape[0], batch, heads, head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        mask = self._local_mask(attn_mask, key_padding_mask, batch, length, k.shape[2], q.dtype)
        scores = q @ k.transpose(-2, -1) / head_dim**0.5
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if self.training and self.dropout > 0:
            weights = F.dropout(weights, p=self.dropout)
        attended = (weights @ v).permute(2, 0, 1, 3).reshape(length, batch, heads * head_dim)
        out = F.linear(attended, _local(self.out_proj.weight))  # this rank's heads' share of the sum
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        bias = self.out_proj.bias
        if seq_dim is not None:
            out = _ReduceScatterSequence.apply(out, seq_dim, self.tp_group)
            bias = bias.to_local(grad_placements=[Partial()]) if isinstance(bias, DTensor) else bias
        else:
            out = _SumOverRanks.apply(out, self.tp_group)
        if bias is not None:
            out = out + _local(bias)
        if not batched:
            out = out.squeeze(1)
        return out, self._gathered_weights(weights, average_attn_weights, batched) if need_weights else None

    def _to_ranks(self, x: Tensor) -> Tensor:
        if self.sequence_dim is not None:  # gathered on entry: its backward sums the gradient already
            return x
        return _CopyToRanks.apply(x, self.tp_group)

    def _local_mask(
        self, attn_mask: Tensor | None, padding: Tensor | None, batch: int, length: int, source: int, dtype: Any
    ) -> Tensor | None:
        """One additive mask ``(B, local heads, L, S)`` from ``attn_mask`` (``(L, S)`` or ``(B·all heads, L, S)``;
        ``True`` = not allowed) and ``key_padding_mask`` (``(B, S)``; ``True`` = ignore)."""
        mask = None
        if attn_mask is not None:
            mask = _additive(attn_mask, dtype)
            if mask.dim() == 3:  # per head, over all heads: keep this rank's
                rank, tp = dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)
                mask = mask.view(batch, self.num_heads * tp, length, source)
                mask = mask[:, rank * self.num_heads : (rank + 1) * self.num_heads]
        if padding is not None:
            pad = _additive(padding, dtype).view(batch, 1, 1, source)
            mask = pad if mask is None else mask + pad
        return mask

    def _gathered_weights(self, weights: Tensor, average: bool, batched: bool) -> Tensor:
        """Attention weights over all heads (averaged over them when ``average``), as nn.MultiheadAttention returns."""
        weights = weights.detach()
        if average:
            total = weights.sum(dim=1)
            dist.all_reduce(total, group=self.tp_group)
            result = total / (self.num_heads * dist.get_world_size(self.tp_group))
        else:
            parts = [torch.empty_like(weights) for _ in range(dist.get_world_size(self.tp_group))]
            dist.all_gather(parts, weights.contiguous(), group=self.tp_group)
            result = torch.cat(parts, dim=1)
        return result if batched else result.squeeze(0)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def _local(tensor: Tensor | None) -> Tensor | None:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
