"""Context parallelism in a strategy: :mod:`.sequence_shards` (the mixin: sequence shards, global positions, the
attention dispatch, a causal LM's label shift) and :mod:`.part` (its part in a step)."""
