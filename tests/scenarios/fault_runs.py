"""One rank fails at global step 2 of an fsdp2 fit; every process must end soon after, naming the rank and its error.

python tests/scenarios/fault_runs.py --devices 2 --out r.json --workdir DIR --scenarios raise_in_step

Each scenario is its own launch (the job dies). The failing rank writes the time of its failure to
``DIR/fault_time`` just before it fails, so the test can measure how long the other ranks took to end.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
from common import make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]

from examples.gpt import GPT
from lightning_dist import FSDP2Strategy

FAULT_STEP = 2
HANG_TIMEOUT = 15  # seconds: the collective timeout of the "hang" scenario


class Faulty(GPT):
    """The example GPT; at step ``FAULT_STEP`` rank ``rank`` fails the way ``fault`` says."""

    def __init__(self, fault: str, rank: int, workdir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fault, self.faulty_rank, self.workdir = fault, rank, workdir

    def _now_failing(self) -> bool:
        if self.trainer.global_step != FAULT_STEP or self.global_rank != self.faulty_rank:
            return False
        Path(self.workdir, "fault_time").write_text(repr(time.time()))
        return True

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self._now_failing():
            if self.fault == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "hang":  # stops answering: its peers wait in the next collective until the timeout
                time.sleep(600)
            if self.fault == "backward":
                loss.register_hook(_raise_in_backward)
                return loss
            raise RuntimeError(f"boom in training_step on rank {self.global_rank}")
        return loss


def _raise_in_backward(grad: Any) -> Any:
    raise RuntimeError("boom in backward on rank 1")


def _fit(devices: int, workdir: str, fault: str, rank: int) -> None:
    template, data = make_model_and_data(devices)
    model = Faulty(fault, rank, workdir, **template.hparams)
    strategy = FSDP2Strategy(timeout=timedelta(seconds=HANG_TIMEOUT)) if fault == "hang" else FSDP2Strategy()
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="64-true"), max_steps=6)
    trainer.fit(model, data)


def _failing(fault: str, rank: int) -> Any:
    def scenario(devices: int, workdir: str) -> dict[str, Any]:
        _fit(devices, workdir, fault, rank)
        return {}

    return scenario


def stuck_after_raise(devices: int, workdir: str) -> dict[str, Any]:
    """Rank 1 raises, then its process stays alive (a slow teardown, a stuck save): its peer, blocked in a collective
    that rank 1 will never join, must not wait for the collective timeout."""
    try:
        _fit(devices, workdir, "raise", 1)
    finally:
        if int(os.environ.get("LOCAL_RANK", "0")) == 1:
            time.sleep(300)
    return {}


SCENARIOS = {
    "raise_in_step": _failing("raise", 1),
    "raise_in_backward": _failing("backward", 1),
    "rank0_raises": _failing("raise", 0),
    "sigkill": _failing("sigkill", 1),
    "hang": _failing("hang", 1),
    "stuck_after_raise": stuck_after_raise,
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
