"""Dry-run ranks, each in a process of its own, forked from one that has imported torch and Lightning once.

Each rank gets a fresh process: torch keeps state across process groups (DTensor's sharding caches hold device meshes,
which compare equal between ranks of one world but name the groups of the rank that made them), so a second rank in
the same process could run on the first one's groups. Starting a Python for each rank would import torch, Lightning
and torchmetrics each time (about 6 s of CPU, more than a small rank's whole run), so one server process
(``python -m lightning_dist.dryrun.rank_process``) imports them and builds the configuration once (:func:`warm`: what
the configuration imports on top, a Hugging Face model's code, is imported once), then forks a child per rank; it
has no thread and no process group when it forks (the one it built the configuration in is destroyed). Each child
writes its record to a file and its output (Lightning's lines, torch's C++ warnings) to another.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning_dist.dryrun.fake_world import fake_rank
from lightning_dist.dryrun.rank_run import RankRecord, build_trainer, quiet, run_rank
from lightning_dist.progress import Progress

_POLL_SECONDS = 0.25  # how often the ranks done are counted
#: What the server imports before it forks (a module the configuration needs beyond these, each rank imports).
PRELOAD = ("lightning_dist.dryrun.rank_run", "lightning_dist.strategies")


def run_ranks(
    batches: list[list[dict[str, Any]]], workers: list[int], python_path: str, progress: bool = False
) -> list[RankRecord]:
    """Run each task (:func:`run_task`'s argument) in a process of its own: the batches one after another, the
    tasks of batch ``i`` ``workers[i]`` at a time; ``progress``: show the ranks done on stderr."""
    results = [Path(task["result"]) for batch in batches for task in batch]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        server = subprocess.Popen([sys.executable, "-m", "lightning_dist.dryrun.rank_process"], stdin=subprocess.PIPE,
                                  stdout=out, stderr=err, text=True, env={**os.environ, "PYTHONPATH": python_path})  # fmt: skip
        assert server.stdin is not None
        server.stdin.write(json.dumps({"batches": batches, "workers": workers}))
        server.stdin.close()
        with Progress(len(results), "dryrun", unit="ranks", quiet=not progress) as shown:
            while server.poll() is None:
                time.sleep(_POLL_SECONDS)
                shown.update(sum(result.exists() for result in results) - shown.done)
            shown.update(sum(result.exists() for result in results) - shown.done)
        err.seek(0)
        done = subprocess.CompletedProcess(server.args, server.returncode, "", err.read())
    records = []
    for task in (task for batch in batches for task in batch):
        result = Path(task["result"])
        if result.exists():
            records.append(RankRecord.from_json(json.loads(result.read_text())))
            continue
        log = Path(task["log"])
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        lines = lines or done.stderr.strip().splitlines()
        why = " | ".join(lines[-3:]) or f"status {done.returncode}"
        records.append(RankRecord(task["rank"], task["role"], error=f"the rank's process ended: {why}"))
    return records


def run_task(task: dict[str, Any]) -> None:
    """One rank: its record as JSON in ``task["result"]`` (written last: a rank that died has none)."""
    try:
        mailbox = Path(task["mailbox"]) if task.get("mailbox") else None
        record = run_rank(task["cli_args"], task["rank"], task["role"], task["world_size"], task["num_nodes"], mailbox,
                          task.get("peers", ()))  # fmt: skip
    except Exception as error:  # noqa: BLE001 (reported for this rank: its message)
        record = RankRecord(task["rank"], task["role"], error=f"{type(error).__name__}: {error}")
    partial = Path(task["result"] + ".partial")
    partial.write_text(json.dumps(record.to_json()))
    partial.replace(task["result"])


def warm(cli_args: list[str], world_size: int, num_nodes: int) -> None:
    """Build the configuration once, as rank 0 and as ``mesh_of`` does, then let it go: the modules it imports (a
    Hugging Face model's configuration and modeling code) are imported once for all the ranks forked after. Then
    every object alive is left out of the garbage collector's later passes (``gc.freeze``): each rank's full
    collections no longer walk the server's imports."""
    # whatever fails here fails again in each rank, which reports it
    with contextlib.suppress(Exception, SystemExit), quiet(), fake_rank(0, world_size, world_size // num_nodes):
        build_trainer(cli_args, world_size, num_nodes)
    gc.collect()
    gc.freeze()


def _serve(batches: list[list[dict[str, Any]]], workers: list[int]) -> None:
    for batch, at_once in zip(batches, workers):
        running: set[int] = set()
        for task in batch:
            while len(running) >= at_once:
                running.discard(os.wait()[0])
            running.add(_fork(task))
        while running:
            running.discard(os.wait()[0])


def _fork(task: dict[str, Any]) -> int:
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        with open(task["log"], "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        run_task(task)
        status = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # the server's exit handlers are not this child's


if __name__ == "__main__":
    for module in PRELOAD:
        __import__(module)
    request = json.loads(sys.stdin.read())
    first = request["batches"][0][0]
    warm(first["cli_args"], first["world_size"], first["num_nodes"])
    _serve(request["batches"], request["workers"])
