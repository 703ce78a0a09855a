"""Hybrid3DStrategy in a real Trainer: the unchanged example GPT on meshes that combine two or three of pp, dp, cp
and tp, each against one process on the same global batch (fp64). A scenario name is a mesh, ``pp2_tp2`` or
``pp2_dp2_tp2`` (``hsdp2`` for dp_replicate=2 × dp_shard=2); every rank saves its final parameters (whole tensors of its stages) for the test.

python tests/scenarios/hybrid3d_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
python tests/scenarios/hybrid3d_runs.py --devices 4 --out r.json --workdir DIR --scenarios pp2_dp2,pp2_tp2,...
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import lightning as L
import torch
from common import (  # type: ignore[import-not-found]
    StepRecorder,
    full_state,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)

from lightning_dist import Hybrid3DStrategy
from lightning_dist.parallel.grad_clip import total_grad_norm

STEPS = 4
AXES = {"pp": "pipeline_parallel_size", "dp": "data_parallel_shard_size", "cp": "context_parallel_size",
        "tp": "tensor_parallel_size", "hsdp": "data_parallel_replicate_size"}  # fmt: skip


def mesh_options(name: str) -> dict[str, int]:
    """``"pp2_dp2_tp2"`` → the strategy's size options (``hsdp2`` is dp_replicate=2 × dp_shard=2)."""
    options = {AXES[axis]: int(size) for axis, size in re.findall(r"([a-z]+)(\d+)", name)}
    options.setdefault("data_parallel_shard_size", 2 if "data_parallel_replicate_size" in options else 1)
    return options


class AllStagesRecorder(StepRecorder):
    """:class:`StepRecorder` whose gradient norm covers every pipeline stage, not only this rank's."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        pipelined = getattr(trainer.strategy, "pipelined", False)
        group = trainer.strategy.process_group("pp") if pipelined else None
        self.grad_norms.append(float(total_grad_norm(pl_module.parameters(), stage_group=group)))


def _run(devices: int, strategy: Any, batch_replicas: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    model, data = make_model_and_data(devices, dp_size=batch_replicas, vocab_size=64)  # tp=2 divides 64 (data: 63)
    recorder = AllStagesRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", callbacks=[recorder]),
        max_steps=STEPS,
        val_check_interval=STEPS,
    )
    trainer.fit(model, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "val": metrics}, full_state(model)


def reference(devices: int, workdir: str) -> dict[str, Any]:
    """One process, the whole batch and sequence: what every mesh must match."""
    result, state = _run(1, "auto", 1)
    torch.save(state, f"{workdir}/reference.pt")
    return result


def hybrid(name: str, devices: int, workdir: str) -> dict[str, Any]:
    options = mesh_options(name)
    strategy = Hybrid3DStrategy(**options)
    replicas = options["data_parallel_shard_size"] * options.get("data_parallel_replicate_size", 1)
    result, state = _run(devices, strategy, replicas)
    torch.save(state, f"{workdir}/{name}.rank{strategy.global_rank}.pt")  # a pipeline rank holds its stages only
    result["mesh"] = str(strategy.parallel_dims)
    result["local_parameters"] = sum(p.numel() for p in strategy.lightning_module.parameters())
    return result


MESHES = ["pp2_dp2", "pp2_tp2", "pp2_cp2", "dp2_tp2", "dp2_cp2", "cp2_tp2", "hsdp2", "pp2_dp2_tp2", "pp2_cp2_dp2",
          "dp2_cp2_tp2"]  # fmt: skip
SCENARIOS: dict[str, Any] = {"reference": reference, **{name: partial(hybrid, name) for name in MESHES}}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
