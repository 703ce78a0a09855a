"""How fused query/key/value projections order their output rows, told from the module and its config.

Two orders occur in the common libraries:

- ``"blocks"``: all query heads, then all key heads, then all value heads (``[Q | K | V]``): ``nn.MultiheadAttention``'s
  ``in_proj_weight``, Hugging Face GPT-2's ``c_attn`` (a ``Conv1D``), litgpt's ``qkv`` and Phi-3's ``qkv_proj`` (with
  fewer key/value heads under grouped-query attention).
- ``"per_head"``: query, key and value of head 0, then of head 1, ... (GPT-NeoX/Pythia's ``query_key_value``, and
  Falcon's in its original multi-head form).
- ``"per_group"``: for each key/value head, the query heads that use it, then its key and its value (Falcon's
  ``query_key_value`` with ``new_decoder_architecture``).

Sharding by heads gives rank ``r`` the rows of its heads of q, k and v. For ``"per_head"`` and ``"per_group"`` those rows are
contiguous already; for ``"blocks"`` they are three pieces, so the rows are permuted once (:func:`rank_grouped_order`) into rank
order and sharded contiguously (:func:`block_rank_order` does the same for a fused ``[gate | up]`` MLP projection).
Nothing here guesses: a layout not told apart by class and config is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

Order = Literal["blocks", "per_head", "per_group"]


@dataclass(frozen=True)
class FusedLayout:
    """Row order of a fused projection.

    Attributes:
        order: ``"blocks"`` or ``"per_head"`` (see the module docstring).
        num_heads: Query heads.
        num_kv_heads: Key/value heads.
        head_dim: Width of one head.
        count_attributes: Attribute of the attention module (dotted: of an object it holds, such as litgpt's
            ``config.n_head``) → global value, each to become value ÷ tp.
    """

    order: Order
    num_heads: int
    num_kv_heads: int
    head_dim: int
    count_attributes: dict[str, int] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


def fused_layout(attention: nn.Module, child: str, projection: nn.Module) -> FusedLayout | str:
    """The layout of ``attention``'s fused projection ``child``, or why it cannot be told (a message)."""
    rows = _output_features(projection)
    cls = type(attention).__name__
    if child == "c_attn" and type(projection).__name__ == "Conv1D":
        heads, split = getattr(attention, "num_heads", None), getattr(attention, "split_size", None)
        if getattr(attention, "is_cross_attention", False):
            return "GPT-2 cross-attention (c_attn holds only key/value) is not planned"
        if not (_count(heads) and _count(split) and rows == 3 * split and split % heads == 0):
            return f"{cls}.c_attn: no num_heads/split_size matching its {rows} output features"
        return FusedLayout("blocks", heads, heads, split // heads, {"num_heads": heads, "split_size": split})
    config = getattr(attention, "config", None)
    if child == "qkv" and all(_count(getattr(config, a, None)) for a in ("n_head", "n_query_groups", "head_size")):
        heads, groups, size = config.n_head, config.n_query_groups, config.head_size
        layout = FusedLayout("blocks", heads, groups, size, {"config.n_head": heads, "config.n_query_groups": groups})
        if rows != layout.rows:
            return f"{cls}.qkv has {rows} output features, not (n_head + 2·n_query_groups)·head_size = {layout.rows}"
        return layout
    if child == "qkv_proj" and cls.startswith("Phi3") and _count(heads := getattr(config, "num_attention_heads", None)):
        # Phi3Attention.forward slices q at config.num_attention_heads · head_dim, k/v by its num_key_value_heads
        kv, size = getattr(attention, "num_key_value_heads", None), getattr(attention, "head_dim", None)
        if not (_count(kv) and _count(size) and rows == (heads + 2 * kv) * size):
            return f"{cls}.qkv_proj: no num_key_value_heads/head_dim matching its {rows} output features"
        return FusedLayout("blocks", heads, kv, size, {"config.num_attention_heads": heads, "num_key_value_heads": kv})
    if child == "query_key_value" and cls.startswith("Falcon"):
        return _falcon_layout(attention, rows)
    if child == "query_key_value" and "NeoX" in cls and _count(heads := getattr(config, "num_attention_heads", None)):
        size = getattr(attention, "head_size", None)
        if not (_count(size) and rows == 3 * heads * size):
            return f"{cls}.query_key_value: no head_size matching its {rows} output features"
        return FusedLayout("per_head", heads, heads, size)
    return (
        f"the order of query/key/value rows in {cls}.{child} could not be told from the module and its config (known:"
        " nn.MultiheadAttention, GPT-2 c_attn, GPT-NeoX and Falcon query_key_value, litgpt qkv, Phi-3 qkv_proj); column-wise sharding would give"
        " each rank a slice of [q|k|v] instead of whole heads"
    )


def rank_grouped_order(layout: FusedLayout, tp: int) -> Tensor | None:
    """Row indices that put each rank's heads (its q, then k, then v) next to each other, rank by rank.

    ``permuted = weight[index]`` is then sharded contiguously over ``tp`` ranks; ``None`` when the rows are in rank
    order already (``"per_head"``). With fewer key/value heads than ranks (``"blocks"`` only), the ``tp / kv_heads``
    consecutive ranks whose query heads use key/value head ``g`` each hold an equal piece of ``[k_g | v_g]``, which
    they gather in forward (:class:`~lightning_dist.parallel.tensor_parallel.fused.FusedColwiseParallel`): every row is still held
    by exactly one rank.
    """
    if layout.order != "blocks":
        return None
    d, kv = layout.head_dim, layout.num_kv_heads
    if kv >= tp:
        return block_rank_order((layout.num_heads * d, kv * d, kv * d), tp)
    # Fewer key/value heads than ranks: the `sharers` ranks using head g hold one piece each of its [k_g | v_g] rows.
    sharers, q_rows = tp // kv, layout.num_heads * d // tp
    piece = 2 * d // sharers
    k_start, v_start = layout.num_heads * d, (layout.num_heads + kv) * d
    pieces = []
    for rank in range(tp):
        group, index = divmod(rank, sharers)
        kv_rows = torch.cat(
            [
                torch.arange(k_start + group * d, k_start + (group + 1) * d),
                torch.arange(v_start + group * d, v_start + (group + 1) * d),
            ]
        )
        pieces += [torch.arange(rank * q_rows, (rank + 1) * q_rows), kv_rows[index * piece : (index + 1) * piece]]
    return torch.cat(pieces)


def block_rank_order(blocks: Sequence[int], tp: int) -> Tensor:
    """Row indices of a projection whose rows are consecutive ``blocks`` (sizes), each split evenly over ``tp``
    ranks, that put rank 0's slice of every block first (in block order), then rank 1's, ...

    ``[gate | up]`` with ``blocks=(I, I)`` gives each rank matching rows of gate and up.
    """
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    pieces = [
        torch.arange(start + rank * (size // tp), start + (rank + 1) * (size // tp))
        for rank in range(tp)
        for start, size in zip(starts, blocks)
    ]
    return torch.cat(pieces)


def _falcon_layout(attention: nn.Module, rows: int) -> FusedLayout | str:
    """Falcon's three forms, told by the attention's own flags (its ``_split_heads`` reads the same ones)."""
    heads, kv, size = (getattr(attention, a, None) for a in ("num_heads", "num_kv_heads", "head_dim"))
    new, multi_query = getattr(attention, "new_decoder_architecture", None), getattr(attention, "multi_query", None)
    if not (_count(heads) and _count(kv) and _count(size) and isinstance(new, bool) and isinstance(multi_query, bool)):
        return f"{type(attention).__name__}.query_key_value: no num_heads/num_kv_heads/head_dim and architecture flags"
    if new:
        layout = FusedLayout("per_group", heads, kv, size, {"num_heads": heads, "num_kv_heads": kv})
    elif multi_query:  # [Q | k | v]: one key/value head
        layout = FusedLayout("blocks", heads, 1, size, {"num_heads": heads})
    else:
        layout = FusedLayout("per_head", heads, heads, size, {"num_heads": heads})
    if rows != layout.rows:
        return f"{type(attention).__name__}.query_key_value has {rows} output features, not {layout.rows}"
    return layout


def _output_features(projection: nn.Module) -> int:
    if type(projection).__name__ == "Conv1D":
        return projection.weight.shape[1]
    return getattr(projection, "out_features", -1)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
