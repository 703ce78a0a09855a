"""``reshard_after_forward`` under a pipeline: pp=2 × dp_shard=2 with 4 micro-batches per step, on and off.

Each scenario fits STEPS optimizer steps of the example GPT in fp64 and reports the losses and the all-gather bytes
this rank sent per training step (FSDP2's parameter gathers inside its stage; counted from the start of each
training batch to its end, optimizer step included). The default (``None``) is off under a pipeline.

python tests/scenarios/reshard_runs.py --devices 4 --out r.json --workdir DIR --scenarios on,off,default
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from common import StepRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback

from lightning_dist import PipelineStrategy
from lightning_dist.profiling import CommCounter

STEPS = 3
MICROBATCHES = 4


class _StepPhase(Callback):
    """Labels the collectives of each training batch (forward, backward and optimizer step) as ``"step"``."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, *args: Any) -> None:
        self.counter.set_phase("step")

    def on_train_batch_end(self, *args: Any) -> None:
        self.counter.set_phase("other")


def _fit(devices: int, reshard_after_forward: bool | None) -> dict[str, Any]:
    model, data = make_model_and_data(devices, dp_size=2, n_layer=4)
    strategy = PipelineStrategy(
        data_parallel_shard_size=2, n_microbatches=MICROBATCHES, reshard_after_forward=reshard_after_forward
    )
    counter, recorder = CommCounter(), StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", limit_val_batches=0),
        max_steps=STEPS,
        callbacks=[recorder, _StepPhase(counter)],
    )
    with counter:
        trainer.fit(model, data)
    gathers = [r for r in counter.records if r.phase == "step" and r.op.startswith("all_gather")]
    return {
        "losses": recorder.losses,
        "all_gather_bytes_per_step": sum(r.sent_bytes for r in gathers) / STEPS,
        "all_gathers_per_step": len(gathers) / STEPS,
        "resolved": trainer.strategy.fsdp_reshard_after_forward(),
    }


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "on": lambda devices, workdir: _fit(devices, True),
    "off": lambda devices, workdir: _fit(devices, False),
    "default": lambda devices, workdir: _fit(devices, None),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
