"""Sequence layouts of context parallelism: which tokens of a sequence each rank of a cp group holds.

* ``"contiguous"``: rank ``r`` holds tokens ``[r·S/cp, (r+1)·S/cp)``.
* ``"zigzag"`` (load-balanced for causal attention): the sequence is cut into ``2·cp`` equal chunks and rank ``r``
  holds chunks ``r`` and ``2·cp−1−r``, so every rank does the same amount of causal-attention work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str) -> None:
    """Raise ``ValueError`` for an unknown layout name."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown context-parallel layout {layout!r}: use one of {list(LAYOUTS)}.")


def check_sequence_length(seq_len: int, cp: int, layout: str) -> None:
    """Raise a ``ValueError`` naming the fix when ``seq_len`` cannot be split over ``cp`` ranks in ``layout``."""
    check_layout(layout)
    parts = 2 * cp if layout == "zigzag" else cp
    if seq_len % parts:
        need = "2·cp" if layout == "zigzag" else "cp"
        fix = math.ceil(seq_len / parts) * parts
        raise ValueError(
            f"Context parallel ({layout} layout) needs the sequence length to be divisible by {need} = {parts}, but"
            f" it is {seq_len} (cp={cp}). Pad or cut the sequences to a multiple of {parts} (e.g. {fix})"
            + (", or use the contiguous layout (divisible by cp)." if layout == "zigzag" else ".")
        )


def _chunk_ids(cp: int, rank: int, layout: str) -> tuple[int, ...]:
    """Which of the sequence's equal chunks rank ``rank`` holds, in local order (``2·cp`` chunks for zigzag)."""
    return (rank, 2 * cp - 1 - rank) if layout == "zigzag" else (rank,)


def shard_sequence(x: Tensor, cp: int, rank: int, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """Rank ``rank``'s part of ``x`` along its sequence dimension ``dim`` (a new contiguous tensor for zigzag)."""
    seq_len = x.shape[dim]
    check_sequence_length(seq_len, cp, layout)
    if layout == "contiguous":
        return x.narrow(dim, rank * (seq_len // cp), seq_len // cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in _chunk_ids(cp, rank, layout)], dim=dim)


def unshard_sequence(shards: Sequence[Tensor], layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The full sequence from every rank's shard (``shards[r]`` is rank ``r``'s), inverse of :func:`shard_sequence`."""
    check_layout(layout)
    cp = len(shards)
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    chunks: list[Tensor | None] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def local_positions(
    seq_len: int, cp: int, rank: int, layout: str = "zigzag", device: torch.device | str | None = None
) -> Tensor:
    """The global position (``0 … seq_len−1``) of each token of rank ``rank``'s shard, shape ``[seq_len / cp]``.

    A model under context parallelism must receive these as its ``position_ids``: the positions it would build
    itself (``arange`` of the local length) are wrong on every rank but the first.
    """
    return shard_sequence(torch.arange(seq_len, device=device), cp, rank, layout, dim=0)
