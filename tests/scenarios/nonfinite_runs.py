"""``on_nonfinite``: a NaN loss on one rank at one step skips that step on every rank, or stops every rank.

python tests/scenarios/nonfinite_runs.py --devices 2 --out r.json --workdir DIR --scenarios skip,stop
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import full_state, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]

from examples.gpt import GPT
from lightning_dist import FSDP2Strategy
from lightning_dist.parallel.runtime.nonfinite import NonFiniteError

POISONED_STEP, POISONED_RANK, STEPS = 2, 1, 4


class Poisoned(GPT):
    """The example GPT, whose loss on one rank at one optimizer step is NaN."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_step == POISONED_STEP and self.global_rank == POISONED_RANK:
            loss = loss * float("nan")
        return loss


class StateRecorder(L.Callback):
    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.states.append(full_state(pl_module))


def _fit(devices: int, mode: str, callbacks: list) -> L.Trainer:
    template, data = make_model_and_data(devices)
    model = Poisoned(**template.hparams)
    strategy = FSDP2Strategy(on_nonfinite=mode)
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true"), max_steps=STEPS, callbacks=callbacks
    )
    trainer.fit(model, data)
    return trainer


def skip(devices: int, workdir: str) -> dict[str, Any]:
    recorder = StateRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(devices, "skip", [recorder])
    changed = [
        max(float((after[k] - before[k]).abs().max()) for k in after)
        for before, after in zip(recorder.states, recorder.states[1:])
    ]
    return {
        "changes": changed,  # between consecutive steps: 0 exactly at the skipped step
        "skipped": trainer.strategy.skipped_non_finite_steps,
        "warnings": [str(w.message) for w in caught if "on_nonfinite" in str(w.message)],
        "finite_after": all(bool(torch.isfinite(t).all()) for t in recorder.states[-1].values()),
    }


def stop(devices: int, workdir: str) -> dict[str, Any]:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    start = time.monotonic()
    message = None
    try:
        _fit(devices, "stop", [])
    except NonFiniteError as err:
        message = str(err)
    mine = Path(workdir, f"stop_rank{rank}.json")  # written whole, then renamed: a peer never reads it half written
    mine.with_suffix(".partial").write_text(json.dumps({"message": message}))
    mine.with_suffix(".partial").replace(mine)
    seconds = time.monotonic() - start
    files = [Path(workdir, f"stop_rank{r}.json") for r in range(devices)]
    while not all(f.exists() for f in files) and time.monotonic() - start < 60:
        time.sleep(0.1)
    return {"messages": [json.loads(f.read_text())["message"] for f in files], "seconds": seconds}


SCENARIOS = {"skip": skip, "stop": stop}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
