"""The random number generators of a rank: kept across checks that must draw nothing, and shared from rank 0.

A strategy's ranks must draw the same numbers where one process draws once for all of them (dropout on activations
that tensor- or context-parallel peers hold alike, a random mask in ``training_step``). Lightning's DDP re-seeds
every rank at setup (``reset_seed``), which rewinds the stream to where the user seeded it: dropout then draws other
masks than one process, which kept drawing from where its model initialization left the stream. Every rank ran the
user's script up to ``fit``, so rank 0's state is the one process's; :func:`share_random_state` gives it to every rank,
which also heals ranks whose streams parted (code that ran on one rank only, an earlier ``fit`` in the same script).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


@contextmanager
def rng_kept() -> Iterator[None]:
    """The Python, NumPy and torch (CPU) generators as they were on entry, on exit."""
    python = random.getstate()
    numpy = _numpy()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def share_random_state(device: torch.device, group: Any = None) -> None:
    """Set every rank's Python, NumPy and torch generators (CPU, and the current accelerator device's) to rank 0's.
    Collective over ``group`` (default: the world)."""
    numpy = _numpy()
    # Every rank builds its own (rank 0's wins): a dry run's rank then broadcasts what rank 0 would, byte for byte
    states: list[Any] = [
        {
            "python": random.getstate(),
            "numpy": numpy.random.get_state() if numpy is not None else None,
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None,
        }
    ]
    dist.broadcast_object_list(states, src=0, group=group, device=device if device.type == "cuda" else None)
    shared = states[0]
    random.setstate(shared["python"])
    if numpy is not None and shared["numpy"] is not None:
        numpy.random.set_state(shared["numpy"])
    torch.set_rng_state(shared["torch"])
    if device.type == "cuda" and shared["cuda"] is not None:
        torch.cuda.set_rng_state(shared["cuda"])


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
