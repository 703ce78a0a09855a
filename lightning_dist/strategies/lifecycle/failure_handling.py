"""How a lightning_dist job ends when one rank fails: every rank, within seconds, naming the rank and its error.

Under a torchrun restart, the process group also gets a store of its own attempt (:func:`restart_store_kwargs`).

The strategy starts a :class:`~lightning_dist.parallel.runtime.watchdog.FailureWatchdog` once the process group exists,
publishes its own exception from ``on_exception``, and stops the watchdog in ``teardown``. When the watchdog finds
another rank's failure while this rank is still running, this rank ends itself: on NCCL it first aborts its process
groups so that the collective it is blocked in raises and Lightning's normal exception path runs (and kills the
processes it launched); if that does not end it within a few seconds, or on a backend that cannot abort (gloo), it
kills the ranks it launched and exits with status 1.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_dist.compat import abort_process_groups, default_store
from lightning_dist.parallel.runtime.activity import is_timeout, main_thread_activity
from lightning_dist.parallel.runtime.watchdog import FailureWatchdog

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

_ABORT_GRACE_SECONDS = 10.0
_ROOT_CAUSE_WAIT_SECONDS = 3.0
_setups = itertools.count()  # the same sequence on every rank: each setup of the same processes gets its own keys
_started: weakref.WeakSet[FailureWatchdog] = weakref.WeakSet()  # a running thread keeps its watchdog in here


def start_watchdog(strategy: MeshParallelStrategy) -> FailureWatchdog | None:
    """Start watching for other ranks' failures (a no-op without a process group, with a single rank, or on the fake
    backend of a dry run, whose peers do not exist)."""
    store = default_store()
    if store is None or strategy.world_size < 2 or dist.get_backend() == "fake":
        return None
    rank = strategy.global_rank
    watchdog = FailureWatchdog(
        store,
        prefix=_key_prefix(),
        rank=rank,
        world_size=strategy.world_size,
        on_failure=lambda message: _end_this_rank(strategy, rank, message),
        check_local=lambda: launched_rank_failure(strategy),
        # gloo's collectives hold the calling thread until they end: where it waits tells a hung rank from the others
        activity=main_thread_activity if dist.get_backend() == "gloo" else None,
    ).start()
    _started.add(watchdog)
    return watchdog


def stop_watchdogs() -> None:
    """Stop every watchdog still running (at exit: a Trainer that never tore down). A daemon thread caught inside a
    store call while the interpreter shuts down is unwound through C++ frames that cannot be unwound, which aborts
    the process ("terminate called without an active exception")."""
    for watchdog in list(_started):
        watchdog.stop()


def restart_store_kwargs(cluster_environment: Any, timeout: timedelta | None) -> dict[str, Any]:
    """``init_process_group`` arguments that keep a torchrun restart from reading the previous attempt's keys.

    torchrun (c10d rendezvous, torch 2.13) hands every attempt of the workers the same shared store, and the default
    process group writes the same keys into it each time: a restarted gloo group can read the dead attempt's
    addresses and fail to connect, or hang. Under a restart the group gets a store prefixed with the attempt.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        cluster_environment.main_address,
        cluster_environment.main_port,
        cluster_environment.world_size(),
        is_master=False,
        timeout=timeout or default_pg_timeout,
    )
    return {"store": dist.PrefixStore(f"lightning_dist/attempt_{attempt}", store)}


def _key_prefix() -> str:
    """Keys of this setup of these processes. torchrun keeps its store across restarts of the workers, so the
    attempt is part of the name: a restarted job must not find the failure that ended the previous attempt."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"lightning_dist/watchdog/attempt_{attempt}/setup_{next(_setups)}"


def launched_rank_failure(strategy: MeshParallelStrategy) -> str | None:
    """``"rank r: ..."`` for the first rank this process launched that has exited with an error (Lightning's launcher
    starts local ranks 1..N-1 from local rank 0), else ``None``."""
    first_rank = strategy.node_rank * strategy.num_processes
    for local_rank, proc in enumerate(_launched_procs(strategy), start=1):
        code = proc.poll()
        if code:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
            return f"rank {first_rank + local_rank}: its process {how}"
    return None


def explain_exception(strategy: MeshParallelStrategy, exception: BaseException) -> None:
    """Publish this rank's exception; if another rank failed first, say that this one follows from it.

    A communication error (a peer's connection closed) is usually the consequence of another rank's failure, which
    may need a moment to become visible (a killed child not yet reaped): look for it first, so that the root cause,
    not its echo, is what every rank reports. A collective that timed out names the ranks this one waited for.
    """
    watchdog, rank = strategy._watchdog, strategy.global_rank
    if watchdog is None:
        return
    if is_timeout(exception) and watchdog.peer_failure() is None:
        blamed = watchdog.report_timeout()
        if blamed is not None:
            _say(rank, f"this rank's {type(exception).__name__} is a collective timeout: {blamed}")
            return
    wait = _ROOT_CAUSE_WAIT_SECONDS if _is_communication_error(exception) else 0.0
    deadline = time.monotonic() + wait
    while (peer := watchdog.peer_failure() or launched_rank_failure(strategy)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    watchdog.report(f"{type(exception).__name__}: {exception}".splitlines()[0][:500])
    if peer is not None:
        _say(rank, f"this rank's {type(exception).__name__} follows the failure of {peer}")


def _is_communication_error(exception: BaseException) -> bool:
    text = str(exception)
    return isinstance(exception, dist.DistError) or any(
        marker in text for marker in ("gloo/transport", "Connection reset", "Connection closed", "NCCL")
    )


def _end_this_rank(strategy: MeshParallelStrategy, rank: int, failure: str) -> None:
    if failure.startswith(f"rank {rank}:"):  # another rank found this one stuck
        _say(rank, f"{failure}. Ending rank {rank}.")
    else:
        _say(rank, f"{failure}. Ending rank {rank} too, instead of waiting for the collective timeout.")
    if dist.is_initialized() and dist.get_backend() == "nccl" and abort_process_groups():
        main = threading.main_thread()
        main.join(timeout=_ABORT_GRACE_SECONDS)  # the aborted collective raises; Lightning ends the process
    _kill_launched_ranks(strategy)
    os._exit(1)


def _launched_procs(strategy: MeshParallelStrategy) -> list[Any]:
    """The processes of the other local ranks, when this process launched them (Lightning's subprocess launcher)."""
    return getattr(strategy.launcher, "procs", None) or []


def _kill_launched_ranks(strategy: MeshParallelStrategy) -> None:
    for proc in _launched_procs(strategy):
        with contextlib.suppress(Exception):  # already gone
            proc.kill()


def _say(rank: int, message: str) -> None:
    sys.stderr.write(f"[rank {rank}] lightning_dist: {message}\n")
    sys.stderr.flush()
