"""Bytes one rank sends per attention layer, per algorithm: the formulas the collectives' counters are tested against.

``b`` batch, ``S`` global sequence length, ``c`` cp degree, ``H`` query heads, ``G`` key/value heads, ``d`` head
dim, ``e`` bytes per element of the inputs, ``a`` bytes per element of the gradient accumulators (4 for fp32 and
lower precisions, 8 for fp64). ``kv = 2·b·(S/c)·G·d`` is the number of key/value elements one rank holds.

================  ==============================  ==============================================
algorithm         forward                         backward
================  ==============================  ==============================================
ring              (c−1)·kv·e                      (c−1)·kv·e + c·kv·a  (K/V again, dK/dV home)
allgather         (c−1)·kv·e                      (c−1)·kv·e + (c−1)·kv·a  (re-gather, reduce-scatter)
ulysses           (c−1)/c·b·(S/c)·(2H+2G)·d·e     same as forward
================  ==============================  ==============================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerBytes:
    """Bytes one rank sends for one attention layer."""

    forward: int
    backward: int


def bytes_per_layer(
    algorithm: str,
    batch: int,
    seq_len: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    cp: int,
    dtype: torch.dtype,
) -> LayerBytes:
    """What one rank of ``cp`` sends in one attention layer's forward and backward (see the module table)."""
    elem = torch.empty((), dtype=dtype).element_size()
    acc = 8 if dtype == torch.float64 else 4
    local = seq_len // cp
    kv = 2 * batch * local * kv_heads * head_dim
    if algorithm == "ring":
        return LayerBytes((cp - 1) * kv * elem, (cp - 1) * kv * elem + cp * kv * acc)
    if algorithm == "allgather":
        return LayerBytes((cp - 1) * kv * elem, (cp - 1) * kv * (elem + acc))
    if algorithm == "ulysses":
        one_way = (cp - 1) * batch * local * (2 * heads + 2 * kv_heads) * head_dim * elem // cp
        return LayerBytes(one_way, one_way)
    raise ValueError(f"Unknown context-parallel attention {algorithm!r}.")
