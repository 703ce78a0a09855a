"""A failing rank ends the whole job within seconds, and the survivors name the rank and its error.

Each case is a 2-process fsdp2 fit in which one rank fails at global step 2 (``tests/scenarios/fault_runs.py``). The
time from the failure to the end of the last process is measured; the target is under 60 s (the collective timeout
would be 30 minutes). Measured on the 2-core CI machine: every case ends within about 1 s of the failure.
"""

from __future__ import annotations

import time

import psutil
import pytest
from launch import FULL_MATRIX, run_failing_scenario

from lightning_dist.parallel.runtime.watchdog import FailureWatchdog

CASES = {
    "raise_in_step": "rank 1: RuntimeError: boom in training_step on rank 1",
    "raise_in_backward": "rank 1: RuntimeError: boom in backward on rank 1",
    "rank0_raises": "rank 0: RuntimeError: boom in training_step on rank 0",
    "sigkill": "rank 1: its process killed by SIGKILL",
    # rank 1 raises, then its process lingers: only the watchdog ends rank 0 (gloo would wait for the timeout)
    "stuck_after_raise": "[rank 0] lightning_dist: rank 1: RuntimeError: boom in training_step on rank 1. Ending rank 0",
    # rank 1 stops answering (sleeps in training_step): rank 0's collective times out, and rank 1 is the one named
    "hang": "[rank 1] lightning_dist: rank 1: stopped answering: it was in training_step (fault_runs.py:",
}


# raise_in_step, raise_in_backward and stuck_after_raise only in the full matrix (tests/launch.py): rank0_raises and
# sigkill run the same watchdog paths, hang the timeout's
IN_FULL_MATRIX = ["raise_in_step", "raise_in_backward", "stuck_after_raise"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [c for c in CASES if FULL_MATRIX or c not in IN_FULL_MATRIX])
def test_every_rank_ends_soon_after_one_fails_naming_it(tmp_path, scenario):
    proc = run_failing_scenario("fault_runs.py", 2, tmp_path, scenario, timeout=240)
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    seconds = ended - float((tmp_path / "fault_time").read_text())
    assert seconds < 60, f"the job ended {seconds:.1f} s after the failure"
    assert CASES[scenario] in output, output[-5000:]
    assert "lightning_dist: rank 0: RuntimeError" not in output or scenario == "rank0_raises", output[-5000:]
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [], f"processes left running: {leftovers}"


def _watchdogs(store, failures, **kwargs):
    return [
        FailureWatchdog(store, "t", rank, 2, on_failure=lambda m, r=rank: failures.append((r, m)), **kwargs).start()
        for rank in range(2)
    ]


def test_a_published_failure_reaches_the_other_rank_once():
    import torch.distributed as dist

    failures: list = []
    zero, one = _watchdogs(dist.HashStore(), failures, interval=0.02)
    one.report("ValueError: bad batch")
    one.stop()
    time.sleep(0.3)
    zero.stop()
    assert failures == [(0, "rank 1: ValueError: bad batch")]


def test_rank_zero_declares_a_rank_without_heartbeat_dead_and_a_normal_stop_is_silent():
    import torch.distributed as dist

    failures: list = []
    zero, one = _watchdogs(dist.HashStore(), failures, interval=0.02, stale_after=0.2)
    time.sleep(0.1)
    one.stop()  # as if killed: its heartbeat stops
    deadline = time.monotonic() + 5
    while not failures and time.monotonic() < deadline:
        time.sleep(0.02)
    zero.stop()
    assert failures == [(0, "rank 1: no heartbeat for 0.2 s (the process died or hangs)")]
    quiet: list = []
    for watchdog in _watchdogs(dist.HashStore(), quiet, interval=0.02):
        watchdog.stop()
    time.sleep(0.1)
    assert quiet == []


def test_rank_zero_finishes_only_after_every_live_rank_stopped_watching():
    """Rank 0's process hosts the store: it waits for a rank still watching (heartbeats advancing), not for one
    whose heartbeat stopped (gone), and not once a failure is published."""
    import threading

    import torch.distributed as dist

    failures: list = []
    zero, one = _watchdogs(dist.HashStore(), failures, interval=0.02)
    zero.stop()
    threading.Timer(0.5, lambda: (one.stop(), one.finish())).start()  # rank 1 still busy for 0.5 s
    start = time.monotonic()
    zero.finish(patience=5.0)
    assert 0.4 < time.monotonic() - start < 3.0
    assert failures == []

    zero, one = _watchdogs(dist.HashStore(), failures, interval=0.02)
    zero.stop(), one.stop()  # rank 1 stopped without saying so: its heartbeat is frozen
    start = time.monotonic()
    zero.finish(patience=0.3)
    assert 0.25 < time.monotonic() - start < 3.0

    zero, one = _watchdogs(dist.HashStore(), failures, interval=0.02)
    zero.stop()  # rank 1 keeps beating and never ends (hung): rank 0 leaves after `limit`
    start = time.monotonic()
    zero.finish(patience=5.0, limit=0.4)
    assert 0.35 < time.monotonic() - start < 3.0
    one.stop()

    zero, one = _watchdogs(dist.HashStore(), failures, interval=0.02)
    zero.stop(), one.stop()
    one.report("RuntimeError: boom")
    start = time.monotonic()
    zero.finish(patience=5.0)
    assert time.monotonic() - start < 1.0


def test_a_timeout_names_the_rank_that_was_in_no_collective_and_that_rank_ends_itself():
    """Rank 0 waited in a collective until the timeout while rank 1 ran its own code: rank 1 is the one named (with
    where it was), and rank 1's watchdog, seeing a failure about itself published by rank 0, ends it."""
    import torch.distributed as dist

    from lightning_dist.parallel.runtime.activity import IN_COLLECTIVE

    store, failures = dist.HashStore(), []
    where = {0: IN_COLLECTIVE, 1: "training_step (model.py:42)"}
    zero, one = (
        FailureWatchdog(store, "t", r, 2, on_failure=lambda m, r=r: failures.append((r, m)), interval=0.02,
                        activity=lambda r=r: where[r]).start()
        for r in range(2)
    )  # fmt: skip
    time.sleep(0.2)  # both have published where they are
    message = zero.report_timeout()
    assert message == (
        "rank 1: stopped answering: it was in training_step (model.py:42) while rank 0 waited for it in a collective"
        " until the timeout"
    )
    deadline = time.monotonic() + 5
    while not failures and time.monotonic() < deadline:
        time.sleep(0.02)
    zero.stop(), one.stop()
    assert failures == [(1, message)]  # rank 0 published it: its own main thread handles it

    both_waiting = {0: IN_COLLECTIVE, 1: IN_COLLECTIVE}  # different collectives on each rank: nobody to name
    store = dist.HashStore()
    watchdogs = [
        FailureWatchdog(store, "t", r, 2, on_failure=print, interval=0.02, activity=lambda r=r: both_waiting[r]).start()
        for r in range(2)
    ]
    time.sleep(0.2)
    assert watchdogs[0].report_timeout() is None
    for watchdog in watchdogs:
        watchdog.stop()


def test_watchdogs_still_running_at_exit_are_stopped():
    """The exit handler stops a watchdog whose Trainer never tore down, so its thread is not inside a store call
    while the interpreter shuts down."""
    import torch.distributed as dist

    from lightning_dist.strategies.lifecycle import failure_handling

    failures: list = []
    watchdogs = _watchdogs(dist.HashStore(), failures, interval=0.02)
    failure_handling._started.update(watchdogs)
    failure_handling.stop_watchdogs()
    assert not any(w._thread.is_alive() for w in watchdogs) and failures == []
