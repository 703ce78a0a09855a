"""The one way benchmarks and tests start processes.

* :func:`start_ranks`: one process per rank, each with the environment ``torchrun`` would give it
  (:func:`rank_env`), watched by :func:`wait_ranks` (which stops at the first failed rank, a timeout or a hang, as the
  caller defines them) and ended by :func:`stop_processes`; :func:`run_ranks` is the three in one, for a worker that
  writes its own result.
* :func:`run_command`: one command whose Lightning ``Trainer(devices=N)`` starts the other ranks itself, or a
  single process; its output captured (or written to a log) and returned.
* :func:`run_torchrun_nodes`: ``torchrun`` itself, as several nodes meeting by rendezvous on this host.

Every child imports this checkout first (:func:`child_env` puts the repository on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from benchmarks.common.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
Problem = TypeVar("Problem")


#: What a Lightning fit in this process leaves in its environment: a ``LOCAL_RANK`` would make Lightning take the child
#: for a rank it did not start, and ``MASTER_PORT`` is still held by this process's store (a one-device fit keeps its
#: process group), so a child that reused it would wait for a rendezvous that never comes.
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "MASTER_PORT", "MASTER_ADDR")


def child_env(extra: dict[str, str] | None = None, drop: Sequence[str] = LAUNCHER_VARIABLES) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, ``drop`` removed (see
    :data:`LAUNCHER_VARIABLES`) and ``extra`` added."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for key in drop:
        env.pop(key, None)
    env.update(extra or {})
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(layout: Layout, rank: int, port: int, threads: int) -> dict[str, str]:
    """Environment of global rank ``rank``, as ``torchrun`` would set it on a node of ``layout.ranks_per_node``."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(layout.world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank % layout.ranks_per_node),
        LOCAL_WORLD_SIZE=str(layout.ranks_per_node),
        GROUP_RANK=str(rank // layout.ranks_per_node),
        TORCHELASTIC_RUN_ID="lightning_dist_benchmarks",
        OMP_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    return env


def start_ranks(
    cmd: list[str], layout: Layout, logs: Sequence[IO[Any]] | None = None, threads: int = 1, cwd: Path = ROOT
) -> list[subprocess.Popen]:
    """Start ``cmd`` once per rank of ``layout`` (a fresh port). Each rank writes to its log in ``logs``, or to this
    process's output when ``logs`` is ``None``."""
    port = free_port()
    return [
        subprocess.Popen(
            cmd,
            env=rank_env(layout, rank, port, threads),
            cwd=str(cwd),
            stdout=logs[rank] if logs is not None else None,
            stderr=subprocess.STDOUT if logs is not None else None,
        )
        for rank in range(layout.world_size)
    ]


def failed_ranks(procs: Sequence[subprocess.Popen]) -> list[int]:
    """The ranks that have exited with an error."""
    return [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]


def wait_ranks(
    procs: Sequence[subprocess.Popen], problem: Callable[[], Problem | None], interval: float = 0.5
) -> Problem | None:
    """Poll every ``interval`` seconds until every rank has exited, or ``problem()`` (a failed rank, a timeout, a
    hang: whatever the caller checks) returns something, which is returned. The ranks are left running."""
    while any(p.poll() is None for p in procs):
        found = problem()
        if found is not None:
            return found
        time.sleep(interval)
    return None


def stop_processes(procs: Sequence[subprocess.Popen], logs: Sequence[IO[Any]] = ()) -> None:
    """Kill the ranks still running (after a failure or a timeout) and close their log files."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()


def run_ranks(cmd: list[str], world_size: int, threads: int = 1, timeout: float | None = None) -> None:
    """``cmd`` on ``world_size`` ranks of one node, their output to this process's (as ``torchrun --standalone``
    runs it). Raises ``CalledProcessError`` for the first rank that fails (the others are killed) and
    ``TimeoutExpired`` after ``timeout`` seconds."""
    procs = start_ranks(cmd, Layout(world_size), threads=threads)
    deadline = None if timeout is None else time.monotonic() + timeout

    def problem() -> subprocess.SubprocessError | None:
        failed = failed_ranks(procs)
        if failed:
            return subprocess.CalledProcessError(procs[failed[0]].returncode, cmd)
        if deadline is not None and time.monotonic() > deadline:
            return subprocess.TimeoutExpired(cmd, timeout or 0)
        return None

    try:
        error = wait_ranks(procs, problem)
        if error is None and failed_ranks(procs):
            error = problem()
    finally:
        stop_processes(procs)
    if error is not None:
        raise error


def run_command(
    cmd: list[str],
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    log: IO[Any] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end (``env``: :func:`child_env` unless given) and return it, whatever its exit status: its
    output captured as text, or written to ``log`` (stdout and stderr together). ``TimeoutExpired`` after
    ``timeout`` seconds."""
    output: dict[str, Any] = (
        {"capture_output": True, "text": True} if log is None else {"stdout": log, "stderr": subprocess.STDOUT}
    )
    return subprocess.run(
        cmd, cwd=str(cwd), env=child_env() if env is None else env, timeout=timeout, check=False, **output
    )


def run_torchrun_nodes(
    cmd: list[str],
    nnodes: int,
    nproc_per_node: int,
    rdzv_id: str,
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    torchrun_args: tuple[str, ...] = (),
) -> list[tuple[int, str]]:
    """``nnodes`` torchrun launches of ``cmd`` (a script and its arguments) with ``nproc_per_node`` ranks each, which
    meet by c10d rendezvous on 127.0.0.1 (as separate machines would, minus the network); ``torchrun_args`` adds
    options. Returns each launch's exit status and output."""
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id={rdzv_id}", *torchrun_args,
    ]  # fmt: skip
    procs = [
        subprocess.Popen([*torchrun, *cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(nnodes)
    ]
    outputs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    return [(p.returncode, output) for p, output in zip(procs, outputs)]
