"""A run restarted by ``torchrun --max-restarts`` resumes by itself from its last complete checkpoint.

    python tests/scenarios/elastic_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
    torchrun --nproc-per-node=2 --max-restarts=1 ... tests/scenarios/elastic_runs.py --devices 2 --scenarios elastic

The script is what a user writes once: ``trainer.fit(model, data, ckpt_path="last")`` with a ``ModelCheckpoint``
that keeps ``last``. On the first attempt rank 1 is killed (SIGKILL) in the middle of step ``KILL_STEP``, mid-epoch;
torchrun starts both workers again, and the second attempt continues from the step-4 checkpoint.
"""

from __future__ import annotations

import os
import signal
from functools import partial
from typing import Any

import lightning as L
from common import (  # type: ignore[import-not-found]
    StepRecorder,
    full_state,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.gpt import GPT
from lightning_dist import FSDP2Strategy

STEPS, SAVE_EVERY, KILL_STEP = 8, 2, 5
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class KilledOnce(GPT):
    """The example GPT; on the first attempt, rank 1 dies inside step KILL_STEP."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if ATTEMPT == 0 and self.trainer.global_step == KILL_STEP and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def run(devices: int, workdir: str, name: str) -> dict[str, Any]:
    template, data = make_model_and_data(devices)
    model = KilledOnce(**template.hparams)
    recorder = StepRecorder()
    checkpoints = ModelCheckpoint(
        dirpath=f"{workdir}/{name}", every_n_train_steps=SAVE_EVERY, save_top_k=-1, save_last=True
    )
    strategy = FSDP2Strategy() if devices > 1 else "auto"
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", enable_checkpointing=True),
        max_steps=STEPS,
        callbacks=[recorder, checkpoints],
    )
    trainer.fit(model, data, ckpt_path="last" if devices > 1 else None)
    return {
        "attempt": ATTEMPT,
        "losses": recorder.losses,  # of this attempt's steps
        "global_step": trainer.global_step,
        "params": {k: v.flatten().tolist() for k, v in full_state(model).items()},
    }


if __name__ == "__main__":
    run_scenario_script({name: partial(run, name=name) for name in ("reference", "elastic")})
