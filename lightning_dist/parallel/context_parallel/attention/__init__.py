"""Context-parallel attention algorithms over a process group (pure PyTorch, CPU/gloo and CUDA/NCCL).

Each computes, from the local sequence shards of ``q: [B, H, L, D]`` and ``k, v: [B, G, L, D]`` (``L = S/cp``,
laid out as in :mod:`.layout`), exactly the local rows of full attention over the whole sequence, with gradients:

* ``"ring"``: key/value shards pass around the group, overlapped with compute (:mod:`.ring`);
* ``"allgather"``: key/value shards are all-gathered, as Llama 3 did (:mod:`.allgather`);
* ``"ulysses"``: all-to-all over heads, then local attention (:mod:`.ulysses`).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from lightning_dist.parallel.context_parallel.attention.allgather import AllGatherAttention
from lightning_dist.parallel.context_parallel.attention.comm import count_bytes_sent
from lightning_dist.parallel.context_parallel.attention.costs import LayerBytes, bytes_per_layer
from lightning_dist.parallel.context_parallel.attention.layout import check_layout
from lightning_dist.parallel.context_parallel.attention.ring import RingAttention
from lightning_dist.parallel.context_parallel.attention.ulysses import UlyssesHeadsError, ulysses_attention

ALGORITHMS = ("ring", "allgather", "ulysses")

__all__ = [
    "ALGORITHMS",
    "LayerBytes",
    "UlyssesHeadsError",
    "bytes_per_layer",
    "context_parallel_attention",
    "count_bytes_sent",
]


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group: Any,
    algorithm: str = "ring",
    layout: str = "zigzag",
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``F.scaled_dot_product_attention`` over the full sequence, computed from the local shards of every cp rank.

    Args:
        query: ``[B, H, L, D]`` (or ``[H, L, D]``), this rank's sequence shard.
        key: ``[B, G, L, D]``; ``G < H`` needs ``enable_gqa=True`` and ``H % G == 0``.
        value: like ``key``.
        group: the context-parallel process group (``None``: the default group).
        algorithm: ``"ring"``, ``"allgather"`` or ``"ulysses"``.
        layout: ``"zigzag"`` or ``"contiguous"``, how the sequence was sharded.
        is_causal: causal attention over global positions.
        scale: softmax scale (default ``1/sqrt(D)``).
        enable_gqa: allow fewer key/value heads than query heads.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"Unknown context-parallel attention {algorithm!r}: use one of {list(ALGORITHMS)}.")
    check_layout(layout)
    unbatched = query.dim() == 3
    if unbatched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    same_tokens = key.shape[-2] == query.shape[-2] and key.shape[0] == query.shape[0]
    if query.dim() != 4 or key.shape != value.shape or not same_tokens or key.shape[-1] != query.shape[-1]:
        raise ValueError(
            "Context parallel attention is self-attention over this rank's sequence shard: it expects query"
            " [B, H, L, D] and key/value [B, G, L, D] with the same B, L and D; got query"
            f" {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}."
        )
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        raise ValueError(
            f"query has {heads} heads and key/value {kv_heads}: fewer key/value heads need enable_gqa=True and a"
            " number of query heads divisible by them (as in F.scaled_dot_product_attention)."
        )
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if algorithm == "ulysses":
        out = ulysses_attention(query, key, value, group, layout, is_causal, scale)
    else:
        function = RingAttention if algorithm == "ring" else AllGatherAttention
        out = function.apply(query, key, value, group, layout, is_causal, scale)
    return out.squeeze(0) if unbatched else out
