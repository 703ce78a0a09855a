"""Measuring the pipeline bubble: the share of a step a rank spends outside its stages' compute.

A rank is *busy* while one of its stages runs a forward, a backward or a weight-gradient chunk; everything else in
the step (waiting for a neighbour's activation or gradient, the schedule's bookkeeping) is idle time. Compared with
``(p−1)/(m+p−1)`` this includes communication and overhead, so it is an upper bound of the schedule's own bubble.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any

_TIMED_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class BusyTimer:
    """Adds up the time the given torch ``PipelineStage`` objects spend computing.

    Usage::

        timer = BusyTimer()
        timer.instrument(runner.stages)      # once per set of stages
        start = time.perf_counter(); runner.step(...); wall = time.perf_counter() - start
        idle = bubble_fraction(timer.take(), wall)
    """

    def __init__(self) -> None:
        self.busy_seconds = 0.0
        self._instrumented: set[int] = set()

    def instrument(self, stages: Iterable[Any]) -> None:
        """Wrap the compute methods of ``stages`` (instance attributes; the class is untouched)."""
        for stage in stages:
            if id(stage) in self._instrumented:
                continue
            self._instrumented.add(id(stage))
            for name in _TIMED_METHODS:
                setattr(stage, name, self._timed(getattr(stage, name)))

    def take(self) -> float:
        """The busy seconds since the last call, and reset."""
        busy, self.busy_seconds = self.busy_seconds, 0.0
        return busy

    def _timed(self, method: Callable) -> Callable:
        @wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.busy_seconds += time.perf_counter() - start

        return timed


def bubble_fraction(busy_seconds: float, wall_seconds: float) -> float:
    """Idle share of a step: ``1 − busy / wall`` (0 when nothing was measured)."""
    if wall_seconds <= 0:
        return 0.0
    return max(0.0, 1.0 - busy_seconds / wall_seconds)
