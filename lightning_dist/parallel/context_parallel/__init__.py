"""Context parallelism for unchanged models, pure PyTorch (no Lightning import): each rank of the cp group holds a
slice of every sequence, and attention runs over the whole sequence. Which file holds what:

- :mod:`.dispatch` — the sequence layouts (``"zigzag"``, ``"contiguous"``) and :class:`ContextParallelAttention`,
  which sends ``F.scaled_dot_product_attention`` on local shards to a cp algorithm.
- :mod:`.attention` — the algorithms (``ring``, ``allgather``, ``ulysses``), their layouts and byte costs.
- :mod:`.batch` — which batch entries are token sequences, their shards, positions, and outputs gathered back.
- :mod:`.labels` — Hugging Face causal LMs: the label shift done on the whole sequence before sharding.
- :mod:`.outputs` — the first-step refusal of a model whose output lost the sequence dimension (pooled).
- :mod:`.rope_tables` — the global rows of rotary tables a model slices by the local length (litgpt).
"""

from lightning_dist.parallel.context_parallel.attention import ALGORITHMS
from lightning_dist.parallel.context_parallel.dispatch import (
    LAYOUTS,
    ContextParallelAttention,
    ContextParallelAttentionError,
    gather_sequence,
    local_positions,
    shard_sequence,
)

__all__ = [
    "ALGORITHMS",
    "LAYOUTS",
    "ContextParallelAttention",
    "ContextParallelAttentionError",
    "gather_sequence",
    "local_positions",
    "shard_sequence",
]
