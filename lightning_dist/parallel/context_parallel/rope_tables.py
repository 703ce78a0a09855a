"""Rotary tables sliced by the sequence length, under context parallelism. Pure PyTorch.

Some models take no positions in training and build rotary embeddings from tables with one row per position,
sliced by the length of the sequence they see: litgpt's ``GPT`` uses ``self.cos[:T]`` and ``self.sin[:T]`` (its
``input_pos`` argument selects inference with a key/value cache, not training positions). On a sequence shard ``T``
is the shard's length and the slice holds the rows of positions ``0..T-1``, wrong on every rank but the first.
:func:`global_rope_rows` makes the tables hold, for the duration of a step, exactly the rows of the shard's global
positions (in the shard's order), so the model's own slice ``[:T]`` picks them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from lightning_dist.compat import buffer_registry
from lightning_dist.parallel.context_parallel.dispatch import local_positions


@contextmanager
def global_rope_rows(
    module: nn.Module, names: tuple[str, ...], seq_len: int, cp: int, rank: int, layout: str
) -> Iterator[None]:
    """Within it, each buffer ``names`` of ``module`` holds only its rows at this rank's global positions (a
    sequence of ``seq_len`` split over ``cp`` ranks in ``layout``); the full tables are back on exit.

    Raises:
        ValueError: the tables have fewer rows than the sequence has positions.
    """
    tables = {name: buffer_registry(module)[name] for name in names}
    rows = min(t.shape[0] for t in tables.values())
    if rows < seq_len:
        raise ValueError(
            f"{type(module).__name__}'s rotary tables ({'/'.join(names)}) have {rows} rows, fewer than the sequence"
            f" length {seq_len}: raise the model's maximum sequence length (block size)."
        )
    try:
        for name, table in tables.items():
            positions = local_positions(seq_len, cp, rank, layout, table.device)
            setattr(module, name, table.index_select(0, positions))
        yield
    finally:
        for name, table in tables.items():
            setattr(module, name, table)
