"""Replica groups as a user runs them under torchft: one lighthouse (in this process), and one Lightning job per
group (a scenario script of ``--devices`` processes, with its own ``MASTER_PORT``, group id and the lighthouse in its
environment), all running at once. :func:`run_replica_groups` can kill one group (SIGKILL to every process of it) once
it reached a step, and relaunch it a few seconds later; it returns each group's result and what it measured."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common.launch import free_port, rank_env
from benchmarks.common.layout import Layout
from benchmarks.common.scenarios import scenario_command


@dataclass
class Chaos:
    """Kill every process of ``group`` once it reports ``at_step``, relaunch it ``relaunch_after`` seconds later.
    ``meanwhile`` (optional) runs in a thread from the kill on, while the other groups train without that one: a
    test's reference run uses the cores they leave idle."""

    group: int = 1
    at_step: int = 10
    relaunch_after: float = 5.0
    meanwhile: Callable[[], Any] | None = None


@dataclass
class GroupsRun:
    results: list[dict[str, Any]]
    killed_at: float | None = None
    relaunched_at: float | None = None
    outputs: list[str] = field(default_factory=list)
    meanwhile: Any = None


def run_replica_groups(
    script: Path,
    devices: int,
    workdir: Path,
    scenario: str,
    groups: int = 2,
    chaos: Chaos | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    join_timeout_ms: int = 20000,
    heartbeat_timeout_ms: int = 2000,
) -> GroupsRun:
    """Run ``scenario`` of ``script`` as ``groups`` replica groups of ``devices`` processes each, with an in-process
    lighthouse. Fails (``AssertionError``) with every group's output when one does not finish cleanly."""
    from lightning_dist.compat.torchft import lighthouse_server

    lighthouse = lighthouse_server(
        bind="[::]:0", min_replicas=1, join_timeout_ms=join_timeout_ms, quorum_tick_ms=100,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    procs: dict[int, subprocess.Popen] = {}
    members: dict[int, list[subprocess.Popen]] = {g: [] for g in range(groups)}
    logs: dict[int, Path] = {}
    outs: dict[int, Path] = {}
    run = GroupsRun(results=[])
    side_run: concurrent.futures.Future | None = None

    def launch(group: int, attempt: int) -> None:
        """Every process of the group at once, as torchrun (or a SLURM step) starts them, in a process group of
        their own (``procs[group]`` is the first, whose pid is the process group's id)."""
        out, cmd, _ = scenario_command(script, devices, workdir, [scenario])
        outs[group] = out.with_name(f"{scenario}_g{group}.json")
        cmd[cmd.index("--out") + 1] = str(outs[group])
        port = free_port()
        logs[group] = workdir / f"{scenario}_g{group}_{attempt}.log"
        launched_at = str(time.time())
        with open(logs[group], "w") as log:
            for rank in range(devices):
                rank_environment = rank_env(Layout(devices), rank, port, threads=1)
                rank_environment.update(env or {})
                rank_environment.update(
                    LIGHTNING_DIST_REPLICA_GROUP_ID=str(group),
                    LIGHTNING_DIST_NUM_REPLICA_GROUPS=str(groups),
                    TORCHFT_LIGHTHOUSE=lighthouse.address(),
                    RUST_LOG="warn",
                    FT_PROGRESS=str(workdir / f"progress_g{group}"),
                    FT_LAUNCHED_AT=launched_at,
                )
                proc = subprocess.Popen(
                    cmd, cwd=workdir, env=rank_environment, stdout=log, stderr=subprocess.STDOUT,
                    process_group=0 if rank == 0 else procs[group].pid,
                )  # fmt: skip
                if rank == 0:
                    procs[group] = proc
                members[group].append(proc)

    try:
        for group in range(groups):
            launch(group, 0)
        deadline = time.time() + timeout
        if chaos is not None:
            progress = workdir / f"progress_g{chaos.group}"
            while _step(progress) < chaos.at_step:
                _check_alive(members, logs, deadline)
                time.sleep(0.05)
            os.killpg(procs[chaos.group].pid, signal.SIGKILL)
            run.killed_at = time.time()
            for proc in members.pop(chaos.group):
                proc.wait()
            members[chaos.group] = []
            if chaos.meanwhile is not None:
                side = concurrent.futures.ThreadPoolExecutor(1)
                side_run = side.submit(chaos.meanwhile)
            time.sleep(chaos.relaunch_after)
            progress.unlink(missing_ok=True)
            launch(chaos.group, 1)
            run.relaunched_at = time.time()
        for proc in [p for group in members.values() for p in group]:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        if side_run is not None:
            run.meanwhile = side_run.result(timeout=max(1.0, deadline - time.time()))
            side.shutdown()
        run.outputs = [logs[g].read_text() for g in range(groups)]
        failed = [g for g in range(groups) if any(p.returncode != 0 for p in members[g]) or not outs[g].exists()]
        if failed:
            raise AssertionError(
                "\n".join(
                    f"--- group {g} exited with {procs[g].returncode} ---\n{run.outputs[g][-8000:]}" for g in failed
                )
            )
        run.results = [json.loads(outs[g].read_text())[scenario] for g in range(groups)]
        return run
    finally:
        for group, first in procs.items():
            if any(p.poll() is None for p in members.get(group, [])):
                _kill_group(first.pid)
        lighthouse.shutdown()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _step(progress: Path) -> int:
    try:
        return int(progress.read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def _check_alive(members: dict[int, list[subprocess.Popen]], logs: dict[int, Path], deadline: float) -> None:
    for group, procs in members.items():
        ended = [p.returncode for p in procs if p.poll() is not None]
        if ended:
            raise AssertionError(f"group {group} ended early ({ended}):\n{logs[group].read_text()[-8000:]}")
    if time.time() > deadline:
        raise AssertionError("the replica groups did not reach the chaos step in time")
