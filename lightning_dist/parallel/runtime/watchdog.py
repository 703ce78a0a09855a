"""A background thread per rank that ends the job when another rank failed, instead of waiting for a collective.

Without it a rank whose peer died waits in its next collective until the process-group timeout (30 minutes by
default): NCCL does so whenever the dead peer leaves its communicator open, and gloo does so while the failing
process is still alive (a slow teardown, a stuck save). The watchdog uses the rendezvous store that every rank
already shares:

* a rank that raises publishes ``rank r: <error>`` under one key (the first failure wins);
* every rank publishes where its main thread is (:mod:`.activity`): when a collective times out, the waiting rank
  names the ranks that were not in any collective (the ones it waited for) instead of itself;
* every rank polls that key once per ``interval`` (one cheap store request, whatever the world size);
* rank 0 also watches one heartbeat counter per rank and publishes a failure for a rank whose counter stopped
  (a ``SIGKILL``, a machine gone), after ``stale_after`` seconds;
* a rank that cannot reach the store at all (the process hosting it is gone) reports that as the failure;
* the process that launched other ranks also sees them exit (``check_local``), within one ``interval``;
* at a normal end every rank says it stopped watching (:meth:`FailureWatchdog.finish`), and rank 0, whose process
  hosts the store in a Lightning or ``torchrun --rdzv-backend=static`` launch, waits for that before it exits: a rank
  still watching would read the store's disappearance as rank 0's death.

What to do about a failure is the caller's ``on_failure`` (the strategy ends the process); the watchdog only finds
it, once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

from lightning_dist.parallel.runtime.activity import IN_COLLECTIVE

FAILED_KEY = "failed"


class FailureWatchdog:
    """Poll the store for a failure of any rank; call ``on_failure(message)`` once, from the watchdog thread.

    Args:
        store: The ``torch.distributed`` store shared by all ranks (``get``, ``set``, ``add``, ``check``,
            ``compare_set``).
        prefix: Key prefix of this run (different per setup of the same processes).
        rank: This process's global rank.
        world_size: Number of ranks.
        on_failure: Called with the failure message when another rank failed or the store became unreachable.
        interval: Seconds between polls and heartbeats.
        stale_after: Seconds without a heartbeat after which rank 0 declares a rank dead.
        check_local: Called at every poll; returns a failure this process can see by itself (a rank it launched
            exited), or ``None``.
        activity: Called at every poll, where it is given: where this rank's main thread is
            (:func:`.activity.main_thread_activity`), published for :meth:`report_timeout`. Meaningful where
            collectives block the calling thread until they end (gloo); NCCL's return before they run.
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world_size: int,
        on_failure: Callable[[str], None],
        interval: float = 1.0,
        stale_after: float = 45.0,
        check_local: Callable[[], str | None] | None = None,
        activity: Callable[[], str] | None = None,
    ) -> None:
        self._check_local = check_local
        self._activity = activity
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._world_size = world_size
        self._on_failure = on_failure
        self._interval = interval
        self._stale_after = stale_after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_dist-watchdog", daemon=True)
        self._seen: dict[int, tuple[int, float]] = {}  # rank 0: last heartbeat count and when it changed
        self._reported = False

    def start(self) -> FailureWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (a normal end: peers may now exit and take the store with them)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self._interval)

    def finish(self, patience: float = 10.0, limit: float = 300.0) -> None:
        """Say that this rank has stopped watching (call after :meth:`stop`, at a normal end). On rank 0, then wait
        until every other rank has said so too, has shown no heartbeat for ``patience`` seconds (it is gone), or a
        failure is published; at most ``limit`` seconds (a rank that keeps beating but never ends is hung).

        Rank 0's process usually hosts the store: leaving earlier takes it away from a rank still busy before its
        own teardown (a slow callback, a loaded machine), whose watchdog then reads that as rank 0's death and ends
        a successful run with an error.
        """
        with contextlib.suppress(Exception):  # the store may be gone already: nothing left to protect
            self._store.set(self._key(f"finished/{self._rank}"), "1")
            if self._rank != 0 or self._reported:
                return
            waiting = set(range(1, self._world_size))
            progress: dict[int, tuple[int, float]] = {}
            deadline = time.monotonic() + limit
            while waiting and not self._published() and time.monotonic() < deadline:
                now = time.monotonic()
                for rank in sorted(waiting):
                    if self._store.check([self._key(f"finished/{rank}")]):
                        waiting.discard(rank)
                        continue
                    beats = self._store.add(self._key(f"heartbeat/{rank}"), 0)
                    last, since = progress.get(rank, (-1, now))
                    if beats != last:
                        progress[rank] = (beats, now)
                    elif now - since > patience:
                        return
                time.sleep(0.02)

    def report(self, message: str) -> None:
        """Publish this rank's failure for the others (keeps an earlier rank's failure if there is one)."""
        self._reported = True
        with contextlib.suppress(Exception):  # the store may be gone already: the others find out through that
            self._publish(f"rank {self._rank}: {message}")

    def report_timeout(self) -> str | None:
        """After a collective of this rank timed out: publish the failure of the ranks it waited for (those whose
        main thread was in no collective, with where it was) and return it; ``None`` when every rank was in a
        collective (they issued different ones) or the others' activity cannot be read."""
        try:
            if self._store.compare_set(self._key("timeout_claim"), "", str(self._rank)).decode() != str(self._rank):
                return self._failure_within(seconds=5.0)  # another rank that timed out names them: once, not N times
            others = self._peer_activities()
        except Exception:  # noqa: BLE001  (the store is gone: nothing to name)
            return None
        away = {rank: where for rank, where in others.items() if where is not None and where != IN_COLLECTIVE}
        if not away:
            return None
        first, where = next(iter(away.items()))
        more = f" (also {', '.join(f'rank {r}: {w}' for r, w in list(away.items())[1:])})" if len(away) > 1 else ""
        message = (
            f"rank {first}: stopped answering: it was in {where}{more} while rank {self._rank} waited for it in a"
            " collective until the timeout"
        )
        self._reported = True
        with contextlib.suppress(Exception):
            self._publish(message)
        return self.published_failure() or message

    def peer_failure(self) -> str | None:
        """The failure another rank published, if any (``"rank r: <error>"``)."""
        with contextlib.suppress(Exception):
            reporter, failure = self._published_record()
            if failure and reporter != self._rank:
                return failure
        return None

    def published_failure(self) -> str | None:
        """The failure published by any rank, this one included, if any."""
        with contextlib.suppress(Exception):
            return self._published() or None
        return None

    def _failure_within(self, seconds: float) -> str | None:
        """The failure published by any rank, waiting up to ``seconds`` for one."""
        deadline = time.monotonic() + seconds
        while (failure := self.published_failure()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return failure

    def _publish(self, message: str) -> None:
        self._store.compare_set(self._key(FAILED_KEY), "", f"{self._rank}|{message}")

    def _published_record(self) -> tuple[int | None, str]:
        """(the rank that published it, the failure) under this prefix (``(None, "")`` if none); raises if the store
        cannot be reached."""
        if not self._store.check([self._key(FAILED_KEY)]):
            return None, ""
        reporter, _, message = self._store.get(self._key(FAILED_KEY)).decode().partition("|")
        return int(reporter), message

    def _published(self) -> str:
        return self._published_record()[1]

    def _peer_activities(self) -> dict[int, str | None]:
        """Where every other rank's main thread was at its last poll (``None``: not published)."""
        ranks = [r for r in range(self._world_size) if r != self._rank]
        keys = [self._key(f"activity/{r}") for r in ranks]
        if self._store.check(keys):  # one request for all (multi_get waits for keys that are missing)
            return {r: value.decode() for r, value in zip(ranks, self._store.multi_get(keys))}
        return {r: self._store.get(k).decode() if self._store.check([k]) else None for r, k in zip(ranks, keys)}

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                failure = self._poll()
            except Exception as err:  # noqa: BLE001
                failure = f"the rendezvous store cannot be reached ({type(err).__name__}): rank 0's process is gone"
            if failure is not None and not self._stop.is_set():
                self._stop.set()
                self._on_failure(failure)
                return

    def _poll(self) -> str | None:
        self._store.add(self._key(f"heartbeat/{self._rank}"), 1)
        if self._activity is not None:
            self._store.set(self._key(f"activity/{self._rank}"), self._activity())
        reporter, failure = self._published_record()
        if failure:  # a failure this rank published is already being handled by its main thread
            return None if reporter == self._rank else failure
        local = self._check_local() if self._check_local is not None else None
        if local is not None:
            self._publish(local)
            return local
        if self._rank == 0:
            stale = self._stale_rank()
            if stale is not None:
                message = f"rank {stale}: no heartbeat for {self._stale_after:g} s (the process died or hangs)"
                self._publish(message)
                return message
        return None

    def _stale_rank(self) -> int | None:
        now = time.monotonic()
        for rank in range(1, self._world_size):
            count = self._store.add(self._key(f"heartbeat/{rank}"), 0)
            last_count, since = self._seen.get(rank, (-1, now))
            if count != last_count:
                self._seen[rank] = (count, now)
            elif now - since > self._stale_after:
                return rank
        return None
