"""A model trained by one Trainer, then handed to new Trainers as notebooks do: ``fit`` again (a fresh optimizer) and
``test``, fp64, under a strategy with 2 processes or in one process (``<strategy>`` = ``one_process``).

python tests/scenarios/model_reuse_runs.py --devices 2 --out r.json --workdir DIR --scenarios reuse_pipeline
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from common import StepRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]

from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
)

STEPS = 2
STRATEGIES: dict[str, tuple[Callable[[int], Any], bool]] = {  # (strategy for d devices, whether every rank is dp)
    "fsdp2": (lambda d: FSDP2Strategy(), True),
    "tensor_parallel": (lambda d: TensorParallelStrategy(tensor_parallel_size=d), False),
    "pipeline": (lambda d: PipelineStrategy(pipeline_parallel_size=d), False),
    "context_parallel": (lambda d: ContextParallelStrategy(context_parallel_size=d), False),
    "hybrid3d": (lambda d: Hybrid3DStrategy(pipeline_parallel_size=d), False),
    "one_process": (lambda d: "auto", False),
}


def _reuse(devices: int, workdir: str, name: str) -> dict[str, Any]:
    make, every_rank_dp = STRATEGIES[name]
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


SCENARIOS = {f"reuse_{name}": lambda d, w, name=name: _reuse(d, w, name) for name in STRATEGIES}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
