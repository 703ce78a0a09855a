"""The collectives of context-parallel attention, each counting the bytes this rank sends.

Counting convention (bytes *sent by one rank*, what the formulas in docs/strategies/context_parallel.md give):

* ring shift: the whole tensor (one send to the next rank);
* all-gather of a ``b``-byte shard over ``c`` ranks: ``(c−1)·b`` (what a ring all-gather sends);
* reduce-scatter to ``b``-byte shards: ``(c−1)·b``;
* all-to-all of a ``b``-byte tensor: ``(c−1)/c·b`` (the part addressed to other ranks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

_ACTIVE_COUNTERS: list[Counter] = []


@contextmanager
def count_bytes_sent() -> Iterator[Counter]:
    """Within the block, the returned ``Counter`` collects bytes sent by this rank, keyed by collective kind
    (``"ring"``, ``"all_gather"``, ``"reduce_scatter"``, ``"all_to_all"``)."""
    counter: Counter = Counter()
    _ACTIVE_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _ACTIVE_COUNTERS.remove(counter)


def _record(kind: str, nbytes: int) -> None:
    for counter in _ACTIVE_COUNTERS:
        counter[kind] += nbytes


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class RingShift:
    """Sends a tensor to the next rank of the group and receives the previous rank's, asynchronously.

    Keeps the sent tensor alive until :meth:`wait`, so the caller may drop its own reference (the NCCL stream may
    still be reading it).
    """

    def __init__(self, tensor: Tensor, group: dist.ProcessGroup | None, tag: int) -> None:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        next_rank = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
        prev_rank = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
        self._sent = tensor.contiguous()
        self._received = torch.empty_like(self._sent)
        ops = [
            dist.P2POp(dist.isend, self._sent, next_rank, group, tag),
            dist.P2POp(dist.irecv, self._received, prev_rank, group, tag),
        ]
        self._works = dist.batch_isend_irecv(ops)
        _record("ring", _nbytes(self._sent))

    def wait(self) -> Tensor:
        """The previous rank's tensor, once both transfers are complete."""
        for work in self._works:
            work.wait()
        self._sent = None  # type: ignore[assignment]
        return self._received


def all_gather(tensor: Tensor, group: dist.ProcessGroup | None) -> list[Tensor]:
    """Every rank's ``tensor``, in group-rank order."""
    tensor = tensor.contiguous()
    size = dist.get_world_size(group)
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    _record("all_gather", (size - 1) * _nbytes(tensor))
    return parts


def reduce_scatter(parts: list[Tensor], group: dist.ProcessGroup | None) -> Tensor:
    """The sum over ranks of ``parts[my_rank]`` (each rank passes one part per rank)."""
    parts = [part.contiguous() for part in parts]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    _record("reduce_scatter", (len(parts) - 1) * _nbytes(out))
    return out


def all_to_all(tensor: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Slice ``i`` of ``tensor``'s dim 0 goes to rank ``i``; slice ``i`` of the result came from rank ``i``."""
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    size = dist.get_world_size(group)
    _record("all_to_all", _nbytes(tensor) * (size - 1) // size)
    return out
