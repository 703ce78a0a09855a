"""One rank of a world of any size, in this process: torch's ``fake`` process-group backend.

Every collective on the fake backend returns at once without data (an all-gather copies the rank's own input into
every slot, so all ranks look alike). The rank's environment is what ``torchrun`` gives a process, so Lightning's
TorchElastic environment is detected and nothing is spawned; the process group exists before the strategy asks for
one, so the strategy's own setup uses it.

Object collectives (``all_gather_object``, ``broadcast_object_list``, ...) pickle through real byte tensors: they run
with the fake tensor mode set aside, and a broadcast is sent from this rank (its receivers would hold what the
source sent; here every rank builds what it would send, see ``parallel/runtime/random_state.py``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from lightning_dist.compat import forget_dtensor_shardings, real_tensors_temporarily, register_fake_backend

#: The variables torchrun sets for each process; Lightning reads them (TorchElasticEnvironment).
RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                  "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list")


@contextmanager
def fake_rank(rank: int, world_size: int, ranks_per_node: int) -> Iterator[None]:
    """Be global rank ``rank`` of ``world_size`` (``ranks_per_node`` per node) until the block ends."""
    saved = {name: os.environ.get(name) for name in RANK_VARIABLES}
    os.environ.update(
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank % ranks_per_node),
        GROUP_RANK=str(rank // ranks_per_node),
        NODE_RANK=str(rank // ranks_per_node),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        TORCHELASTIC_RUN_ID="lightning-dist-dryrun",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # never connected to: the process group below needs no rendezvous
    )
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    originals = {name: getattr(dist, name) for name in _OBJECT_COLLECTIVES}
    for name, function in originals.items():
        setattr(dist, name, _with_real_tensors(_sent_from_here(function) if name.startswith("broadcast") else function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        dist.destroy_process_group()
        forget_dtensor_shardings()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _with_real_tensors(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with real_tensors_temporarily():
            return function(*args, **kwargs)

    return call


def _sent_from_here(broadcast_object_list: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(broadcast_object_list)
    def call(object_list: list[Any], src: int | None = None, group: Any = None, device: Any = None,
             group_src: int | None = None) -> None:  # fmt: skip
        here = dist.get_group_rank(group or dist.group.WORLD, dist.get_rank())
        broadcast_object_list(object_list, group=group, device=device, group_src=here)

    return call
