"""One rank of a world of any size, in this process: torch's ``fake`` process-group backend.

Every collective on the fake backend returns at once without data (an all-gather copies the rank's own input into
every slot, so all ranks look alike). The rank's environment is what ``torchrun`` gives a process, so Lightning's
TorchElastic environment is detected and nothing is spawned; the process group exists before the strategy asks for
one, so the strategy's own setup uses it.

Object collectives (``all_gather_object``, ``broadcast_object_list``, ...) pickle through real byte tensors: they run
with the fake tensor mode set aside, and a broadcast is sent from this rank (its receivers would hold what the
source sent; here every rank builds what it would send, see ``parallel/runtime/random_state.py``).

Point-to-point objects (pipeline stages send each other their activations' shapes before the first step, forward
and backward) go through a folder the ranks of one pipeline share, each in its own process, running at once: a
``send_object_list`` leaves a file there and issues its sends as usual; the matching ``recv_object_list`` waits for
the file and issues the two receives (sizes, then bytes) a real one issues.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist.compat import (
    is_fake_tensor,
    real_tensors_temporarily,
    register_fake_backend,
)
from lightning_dist.dryrun.fake_values import on_real_tensors

#: The variables torchrun sets for each process; Lightning reads them (TorchElasticEnvironment).
RANK_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                  "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
_OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list")
#: Seconds a receive waits for its sender's object before the rank fails.
MAILBOX_TIMEOUT = 600.0


@contextmanager
def fake_rank(
    rank: int, world_size: int, ranks_per_node: int, mailbox: Path | None = None, peers: Sequence[int] = ()
) -> Iterator[None]:
    """Be global rank ``rank`` of ``world_size`` (``ranks_per_node`` per node) until the block ends. ``peers`` are the
    ranks running at the same time (the rank's pipeline); objects they send each other go through the folder
    ``mailbox``."""
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
    originals = {name: getattr(dist, name) for name in (*_OBJECT_COLLECTIVES, "send_object_list", "recv_object_list")}
    replaced = {name: originals[name] for name in _OBJECT_COLLECTIVES}
    box = _Mailbox(mailbox, set(peers)) if mailbox is not None else None
    replaced["broadcast_object_list"] = _broadcast(originals["broadcast_object_list"], box)
    if box is not None:
        replaced["send_object_list"] = _posted(originals["send_object_list"], box)
        replaced["recv_object_list"] = _delivered(box)
    for name, function in replaced.items():
        setattr(dist, name, on_real_tensors(function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)
        dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class _Mailbox:
    """Files ``<src>-<dst>-<n>.pkl`` in a folder: the n-th object list ``src`` sent ``dst``, with its pickled sizes."""

    def __init__(self, folder: Path, peers: set[int]) -> None:
        self.folder = folder
        self.peers = peers
        self.count: dict[tuple[int, int], int] = {}

    def _path(self, src: int, dst: int) -> Path:
        n = self.count.get((src, dst), 0)
        self.count[(src, dst)] = n + 1
        return self.folder / f"{src}-{dst}-{n}.pkl"

    def post(self, objects: list[Any], dst: int) -> None:
        path = self._path(dist.get_rank(), dst)
        sizes = [len(pickle.dumps(obj)) for obj in objects]  # what torch.distributed sends: pickle's default protocol
        partial = path.with_suffix(".partial")
        partial.write_bytes(pickle.dumps((sizes, objects)))
        partial.rename(path)

    def take(self, src: int) -> tuple[list[int], list[Any]]:
        path = self._path(src, dist.get_rank())
        deadline = time.monotonic() + MAILBOX_TIMEOUT
        while not path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {dist.get_rank()} waited {MAILBOX_TIMEOUT:.0f} s for an object from rank {src}"
                )
            time.sleep(0.02)
        return pickle.loads(path.read_bytes())


def _posted(send_object_list: Callable[..., Any], mailbox: _Mailbox) -> Callable[..., Any]:
    @functools.wraps(send_object_list)
    def call(object_list: list[Any], dst: int | None = None, group: Any = None, *args: Any, **kwargs: Any) -> None:
        if dst is None:
            dst = dist.get_global_rank(group or dist.group.WORLD, kwargs.get("group_dst") or 0)
        object_list[:] = [_real_copies(obj) for obj in object_list]
        mailbox.post(object_list, dst)
        send_object_list(object_list, dst, group, *args, **kwargs)

    return call


def _delivered(mailbox: _Mailbox) -> Callable[..., Any]:
    def recv_object_list(object_list: list[Any], src: int | None = None, group: Any = None, device: Any = None,
                         group_src: int | None = None, use_batch: bool = False) -> int:  # fmt: skip
        if src is None:
            src = dist.get_global_rank(group or dist.group.WORLD, group_src or 0)
        sizes, objects = mailbox.take(src)
        # the receives a real one issues: the sizes, then the bytes
        dist.recv(torch.empty(len(sizes), dtype=torch.long), src=src, group=group)
        dist.recv(torch.empty(sum(sizes), dtype=torch.uint8), src=src, group=group)
        object_list[:] = objects
        return src

    return recv_object_list


def _broadcast(broadcast_object_list: Callable[..., Any], mailbox: _Mailbox | None) -> Callable[..., Any]:
    """A broadcast whose source runs beside this rank (a pipeline's loss stage) is delivered through the mailbox;
    otherwise this rank sends what it holds (every rank builds what the source would)."""

    @functools.wraps(broadcast_object_list)
    def call(object_list: list[Any], src: int | None = None, group: Any = None, device: Any = None,
             group_src: int | None = None) -> None:  # fmt: skip
        group = group or dist.group.WORLD
        me = dist.get_rank()
        source = src if src is not None else dist.get_global_rank(group, group_src or 0)
        object_list[:] = [_real_copies(obj) for obj in object_list]
        if mailbox is not None and source in mailbox.peers and source != me:
            sizes, objects = mailbox.take(source)
            root = dist.get_group_rank(group, source)
            dist.broadcast(torch.empty(len(sizes), dtype=torch.long), group=group, group_src=root)
            dist.broadcast(torch.empty(sum(sizes), dtype=torch.uint8), group=group, group_src=root)
            object_list[:] = objects
            return
        if mailbox is not None and source == me:
            for peer in sorted(mailbox.peers & set(dist.get_process_group_ranks(group)) - {me}):
                mailbox.post(object_list, peer)
        broadcast_object_list(object_list, group=group, device=device, group_src=dist.get_group_rank(group, me))

    return call


def _real_copies(value: Any) -> Any:
    """``value`` with every fake tensor replaced by a real one of zeros (to be pickled as a real one would be)."""
    if is_fake_tensor(value):
        with real_tensors_temporarily():
            return torch.zeros(value.shape, dtype=value.dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_real_copies(v) for v in value)
    if isinstance(value, dict):
        return {k: _real_copies(v) for k, v in value.items()}
    return value
