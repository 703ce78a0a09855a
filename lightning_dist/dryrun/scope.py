"""Where a dry-run rank's work runs on fake tensors, and what is recorded of it.

Only the strategy's model work is fake: its ``setup`` (parallelize, materialize, optimizers) and the step
(``optimizer_step``, which runs the closure, ``training_step`` and ``backward``). Lightning's own work around them
(the data loader, logging, callbacks) runs on real tensors, and what it does with a fake loss goes through the
tensor's fake mode. One optimizer step runs; its memory is measured, and a later step's is projected from it (the
first one's peak before the optimizer update plus the optimizer states it made: see ``LiveMemory.mark_update``).
Outside the strategy's work, the collective counter's own dispatch mode records Lightning's collectives; inside it,
the fake tensor mode records them for the counter (one dispatch layer, not two), also those of functions run on real
tensors; during the step a memory tracker sits on top.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import Callback

from lightning_dist.dryrun.attention import fused_attention
from lightning_dist.dryrun.fake_values import DryRunTensorMode, on_real_tensors
from lightning_dist.profiling import CommCounter, CommRecord
from lightning_dist.profiling.live_memory import LiveMemory

#: Strategy methods that run in the fake mode; those marked True are the step, whose memory is tracked.
FAKE_STRATEGY_METHODS: dict[str, bool] = {"setup": False, "optimizer_step": True, "training_step": True,
                                          "backward": True}  # fmt: skip
#: LightningModule methods that run on real tensors (Lightning's logging copies real defaults).
REAL_MODULE_METHODS = ("log", "log_dict")


class RankScope:
    """Install on a Trainer's strategy and module, then ``with scope.recording(): trainer.fit(...)``."""

    def __init__(self) -> None:
        self.mode = DryRunTensorMode()
        self.counter = CommCounter()
        self.memory_peak: dict[str, int] = {}  # the step run
        self.later_peak: dict[str, int] = {}  # a later step's, projected (see LiveMemory.mark_update)
        self._strategy: Any = None
        self._depth = 0
        self._tracker: LiveMemory | None = None

    def install(self, trainer: Any, module: Any) -> None:
        strategy = self._strategy = trainer.strategy
        trainer.callbacks.append(_Hooks(self))
        for name, is_step in FAKE_STRATEGY_METHODS.items():
            setattr(strategy, name, self._in_fake_mode(getattr(strategy, name), is_step, name))
        for name in REAL_MODULE_METHODS:
            setattr(module, name, on_real_tensors(getattr(module, name)))

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Collectives are labelled ``launch`` (the process group and mesh), ``setup`` (the strategy's), ``prepare``
        (Lightning's data and loops after setup), ``train`` (Lightning's own from ``on_train_start`` to the end of the
        batch), ``step`` (the optimizer step, its forward and backward) and ``end`` (after ``on_train_batch_end``)."""
        with self.counter, self.counter.phase("launch"):
            yield

    @property
    def collectives(self) -> list[CommRecord]:
        return self.counter.records

    def _in_fake_mode(self, method: Callable[..., Any], is_step: bool, name: str) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            self.counter.__exit__(None, None, None)  # the fake mode records for it until the method returns
            tracker = None
            try:
                phase = self.counter.phase("step" if is_step else name)
                with fused_attention(), self.mode.counting(self.counter), phase:
                    if is_step:
                        tracker = self._tracker = LiveMemory(self._strategy.model_parts, self._strategy.optimizers)
                        with tracker:
                            return method(*args, **kwargs)
                    return method(*args, **kwargs)
            finally:
                self._depth -= 1
                self.counter.__enter__()
                if name == "setup":
                    self.counter.set_phase("prepare")
                else:  # Lightning's own after the optimizer step, until the batch ends
                    self.counter.set_phase("train")
                if tracker is not None:
                    self.memory_peak = _larger(self.memory_peak, tracker.peak_split())
                    self.later_peak = _larger(self.later_peak, tracker.peak_split(later_step=True))
                    self._tracker = None

        return call


def _larger(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return b if b.get("total", 0) >= a.get("total", 0) else a


class _Hooks(Callback):
    """Lightning's own collectives are labelled ``train`` from ``on_train_start`` and ``end`` after
    ``on_train_batch_end``; the optimizer update's start is marked for the memory of the steps after the first."""

    def __init__(self, scope: RankScope) -> None:
        self.scope = scope

    def on_train_start(self, *args: Any) -> None:
        self.scope.counter.set_phase("train")

    def on_train_batch_end(self, *args: Any) -> None:
        self.scope.counter.set_phase("end")

    def on_before_optimizer_step(self, *args: Any) -> None:
        if self.scope._tracker is not None:
            self.scope._tracker.mark_update()
