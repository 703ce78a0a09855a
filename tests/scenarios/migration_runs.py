"""Real Trainers, 2 processes: a save onto a user's folder is refused on every rank, and a checkpoint written by
Lightning's own ModelParallelStrategy resumes under fsdp2 (migration), and is inspected and consolidated.

python tests/scenarios/migration_runs.py --devices 2 --out r.json --workdir DIR --scenarios refuse_user_folder,...
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from common import (  # type: ignore[import-not-found]
    StepRecorder,
    is_rank_zero,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from examples.gpt import GPT
from lightning_dist import CheckpointError, FSDP2Strategy, FullStateCheckpointIO

STEPS = 6
EPOCH_SAMPLES = 24  # global batch 8: 3 steps per epoch, so the step-3 checkpoint is at an epoch's last batch
SENTINEL = "my notes, not a checkpoint\n"


class ShardedByHand(GPT):
    """The example GPT sharded in configure_model, as Lightning's ModelParallelStrategy requires."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def refuse_user_folder(devices: int, workdir: str) -> dict[str, Any]:
    """``trainer.save_checkpoint`` onto a folder holding the user's files, with the sharded and full-state IO."""
    target = Path(workdir, "ckpts")
    if is_rank_zero():
        target.mkdir(exist_ok=True)
        (target / "notes.txt").write_text(SENTINEL)
    errors = {}
    for name, plugins in (("sharded", None), ("full", [FullStateCheckpointIO()])):
        model, data = make_model_and_data(devices)
        trainer = L.Trainer(**trainer_kwargs(devices, strategy=FSDP2Strategy(), plugins=plugins), max_steps=1)
        trainer.fit(model, data)
        try:
            trainer.save_checkpoint(target)
            errors[name] = None
        except CheckpointError as err:
            errors[name] = str(err)
        errors[f"{name}_all_ranks"] = _all_ranks(errors[name])
    errors["left"] = sorted(p.name for p in target.iterdir())
    errors["notes"] = (target / "notes.txt").read_text()
    return errors


def _all_ranks(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _fit(devices: int, model: L.LightningModule, strategy: Any, workdir: str, name: str, resume: str | None) -> list:
    _, data = make_model_and_data(devices, train_samples=EPOCH_SAMPLES, vocab_size=64)
    recorder = StepRecorder()
    checkpoints = ModelCheckpoint(dirpath=f"{workdir}/{name}", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        # ModelParallelStrategy refuses precision="64-true": the model is made fp64 itself, under "32-true"
        **trainer_kwargs(devices, strategy=strategy, precision="32-true", enable_checkpointing=True),
        max_steps=STEPS,
        callbacks=[recorder, checkpoints],
    )
    trainer.fit(model, data, ckpt_path=resume)
    return recorder.losses


def _gpt(cls: type[GPT]) -> GPT:
    model, _ = make_model_and_data(2, train_samples=EPOCH_SAMPLES, vocab_size=64)
    return cls(**dict(model.hparams)).double()


def lightning_model_parallel(devices: int, workdir: str) -> dict[str, Any]:
    """The reference: 6 steps under Lightning's ModelParallelStrategy, saving at step 3 (and 6)."""
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return {"losses": _fit(devices, _gpt(ShardedByHand), strategy, workdir, "lightning_mp", None)}


def resume_lightning_checkpoint_under_fsdp2(devices: int, workdir: str) -> dict[str, Any]:
    """The unchanged GPT under fsdp2, resumed from Lightning's step-3 checkpoint."""
    resume = f"{workdir}/lightning_mp/step=3.ckpt"
    return {"losses": _fit(devices, _gpt(GPT), FSDP2Strategy(), workdir, "migrated", resume)}


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "refuse_user_folder": refuse_user_folder,
    "lightning_model_parallel": lightning_model_parallel,
    "resume_lightning_checkpoint_under_fsdp2": resume_lightning_checkpoint_under_fsdp2,
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
