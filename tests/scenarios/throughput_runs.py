"""MeshThroughputMonitor in real Trainer runs: what it logs next to a wall clock read around the same loop.

Two ``LoopClock`` callbacks, one before the monitor and one after it, read ``time.perf_counter()`` at the start of
training, at each step where the monitor logs, around validation and at the end of training. The test compares the
logged tokens/s with the tokens it knows a step holds (the global batch) over those readings.

python tests/scenarios/throughput_runs.py --devices 2 --out r.json --workdir DIR --scenarios fsdp2,tensor_parallel
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning as L
from common import make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback

from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    MeshThroughputMonitor,
    TensorParallelStrategy,
)

EVERY = 4  # log_every_n_steps
STEPS = 3 * EVERY


class LoopClock(Callback):
    """Wall-clock readings around the training loop. One instance is placed before the monitor and one after it, so
    each of the monitor's own readings lies between two of ours (a process descheduled between two readings widens
    the bracket, it does not break it)."""

    def __init__(self) -> None:
        self.start = self.end = 0.0
        self.logs: list[dict[str, Any]] = []  # the steps the monitor logs at, and the logged values
        self.validations: list[tuple[float, float]] = []
        self._step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        now = time.perf_counter()
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        if stepped and trainer.global_step % EVERY == 0:  # not on the micro-batches of an accumulated step
            logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("throughput/")}
            self.logs.append({"step": trainer.global_step, "at": now, **logged})

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validations.append((time.perf_counter(), 0.0))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validations[-1] = (self.validations[-1][0], time.perf_counter())

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.end = time.perf_counter()

    def readings(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "logs": self.logs, "validations": self.validations}


def _run(
    strategy: Callable[[], Any], dp: int, accumulate: int = 1, **monitor: Any
) -> Callable[[int, str], dict[str, Any]]:
    def run(devices: int, workdir: str) -> dict[str, Any]:
        model, data = make_model_and_data(devices, dp_size=dp, vocab_size=64)  # tp divides 64
        before, throughput, after = LoopClock(), MeshThroughputMonitor(**monitor), LoopClock()
        trainer = L.Trainer(
            **trainer_kwargs(devices, strategy=strategy(), precision="32-true", val_check_interval=6),
            max_steps=STEPS,
            accumulate_grad_batches=accumulate,
            log_every_n_steps=EVERY,
            callbacks=[before, throughput, after],
        )
        trainer.fit(model, data)
        return {
            "vocab_size": model.hparams.vocab_size,
            "world_size": trainer.world_size,
            "accumulate": accumulate,
            "before": before.readings(),  # each of the monitor's readings is after this clock's
            "after": after.readings(),  # and before this one's; the logged values are read here
        }

    return run


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "fsdp2": _run(FSDP2Strategy, dp=2, accumulate=2, peak_tflops=0.5),  # a step is 2 micro-batches
    "tensor_parallel": _run(lambda: TensorParallelStrategy(tensor_parallel_size=2), dp=1),  # no peak: no MFU
    "context_parallel": _run(ContextParallelStrategy, dp=1, peak_tflops=0.5),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
