"""A model trained by one Trainer, then handed to new Trainers as notebooks do: ``fit`` again (a fresh optimizer) and
``test``, fp64, under a strategy with 2 processes or in one process (``<strategy>`` = ``one_process``); and
``load_on_rank_zero``: ``load_from_checkpoint`` of the checkpoint folder by rank 0 alone after a fit.

python tests/scenarios/model_reuse_runs.py --devices 2 --out r.json --workdir DIR --scenarios reuse_pipeline
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from common import (  # type: ignore[import-not-found]
    ALL_RANKS,
    StepRecorder,
    full_state,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dist import FSDP2Strategy

STEPS = 2


def _reuse(devices: int, workdir: str, name: str) -> dict[str, Any]:
    make, every_rank_dp = ALL_RANKS[name]
    model, data = make_model_and_data(devices, dp_size=devices if every_rank_dp else 1, vocab_size=64)
    model = model.double()
    losses = []
    for _ in range(2):  # the second fit: a new Trainer (and strategy), the same model
        recorder = StepRecorder()
        trainer = L.Trainer(
            **trainer_kwargs(devices, strategy=make(devices), precision="64-true"),
            max_steps=STEPS,
            callbacks=[recorder],
        )
        trainer.fit(model, datamodule=data)
        losses += recorder.losses
    tested = L.Trainer(**trainer_kwargs(devices, strategy=make(devices), precision="64-true", limit_test_batches=2))
    return {"losses": losses, "test_loss": tested.test(model, datamodule=data, verbose=False)[0]["test_loss"]}


def _load_on_rank_zero(devices: int, workdir: str) -> dict[str, Any]:
    """After an fsdp2 fit, rank 0 alone loads the best checkpoint folder with ``load_from_checkpoint`` (the export
    habit), then every rank tests with a new Trainer (collectives)."""
    model, data = make_model_and_data(devices, vocab_size=64)
    best = ModelCheckpoint(dirpath=os.path.join(workdir, "rank_zero_load"))
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=FSDP2Strategy(), enable_checkpointing=True),
        max_steps=STEPS,
        callbacks=[best],
    )
    trainer.fit(model, datamodule=data)
    trained = full_state(model)  # collective
    gap = None
    if trainer.is_global_zero:
        loaded = type(model).load_from_checkpoint(best.best_model_path).state_dict()
        gap = max(float((loaded[name] - value).abs().max()) for name, value in trained.items())
    tester = L.Trainer(**trainer_kwargs(devices, strategy=FSDP2Strategy(), limit_test_batches=2))
    return {"gap": gap, "test_loss": tester.test(model, datamodule=data, verbose=False)[0]["test_loss"]}


SCENARIOS = {f"reuse_{name}": lambda d, w, name=name: _reuse(d, w, name) for name in ALL_RANKS}
SCENARIOS["load_on_rank_zero"] = _load_on_rank_zero

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
