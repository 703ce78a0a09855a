"""A model fitted by one Trainer and handed to a second: reused with equal settings, refused with different ones.

python tests/scenarios/reuse_runs.py --devices 2 --out r.json --workdir DIR --scenarios fsdp2_then_tp
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from common import make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]

from lightning_dist import FSDP2Strategy, TensorParallelStrategy

STEPS = 2


def _fit(model: L.LightningModule, data: L.LightningDataModule, devices: int, strategy: Any) -> None:
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="64-true"), max_steps=STEPS)
    trainer.fit(model, data)


def _second_fit(devices: int, workdir: str, name: str, first: Any, second: Any) -> dict[str, Any]:
    """Fit with ``first``, then try ``second`` on the same model; report every rank's error (None: it trained)."""
    model, data = make_model_and_data(devices)
    _fit(model, data, devices, first)
    error = None
    try:
        _fit(model, data, devices, second)
    except RuntimeError as err:
        error = str(err)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    Path(workdir, f"{name}_rank{rank}.json").write_text(json.dumps({"error": error}))
    dist.barrier()  # the first Trainer's process group is still up
    return {"errors": [json.loads(Path(workdir, f"{name}_rank{r}.json").read_text())["error"] for r in range(devices)]}


def fsdp2_then_tp(devices: int, workdir: str) -> dict[str, Any]:
    return _second_fit(
        devices, workdir, "fsdp2_then_tp", FSDP2Strategy(), TensorParallelStrategy(tensor_parallel_size=devices)
    )


def fsdp2_then_grad_op(devices: int, workdir: str) -> dict[str, Any]:
    return _second_fit(devices, workdir, "fsdp2_then_grad_op", FSDP2Strategy(), FSDP2Strategy(sharding="grad_op"))


def fsdp2_then_fsdp2(devices: int, workdir: str) -> dict[str, Any]:
    return _second_fit(devices, workdir, "fsdp2_then_fsdp2", FSDP2Strategy(), FSDP2Strategy())


SCENARIOS = {
    "fsdp2_then_tp": fsdp2_then_tp,
    "fsdp2_then_grad_op": fsdp2_then_grad_op,
    "fsdp2_then_fsdp2": fsdp2_then_fsdp2,
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
