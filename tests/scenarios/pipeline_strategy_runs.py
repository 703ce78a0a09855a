"""PipelineStrategy with a real Trainer and the unchanged example GPT: pp=2 (1f1b, gpipe) against one process.

python tests/scenarios/pipeline_strategy_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
python tests/scenarios/pipeline_strategy_runs.py --devices 2 --out r.json --workdir DIR --scenarios 1f1b,gpipe

(``reference_accumulate`` / ``1f1b_accumulate``: accumulate_grad_batches=2; ``interleaved_1f1b`` and
``zbv_zero_bubble`` compare with ``reference`` too.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import StepRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from lightning_dist import PipelineStrategy

STEPS, CLIP = 4, 0.05


class LoggedLoss(Callback):
    """The ``train_loss`` this rank logged at every optimizer step (read once Lightning has published it)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def _read(self, trainer: L.Trainer) -> None:
        self.values.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > 0:
            self._read(trainer)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._read(trainer)


def _train(
    devices: int, strategy: Any, dp: int = 1, **kwargs: Any
) -> tuple[Any, StepRecorder, LoggedLoss, float, list]:
    model, data = make_model_and_data(devices, dp_size=dp, n_layer=4)
    recorder, logged = StepRecorder(), LoggedLoss()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", gradient_clip_val=CLIP),
        max_steps=STEPS,
        val_check_interval=STEPS,  # one validation loop inside fit, after the last step
        check_val_every_n_epoch=None,
        callbacks=[recorder, logged],
        **kwargs,
    )
    trainer.fit(model, data)
    val = trainer.validate(model, data.val_dataloader(), verbose=False)[0]["val_loss"]
    predictions = trainer.predict(model, data.val_dataloader())
    return model, recorder, logged, float(val), predictions


def _reference(**kwargs: Any) -> Callable[[int, str], dict[str, Any]]:
    def run(devices: int, workdir: str) -> dict[str, Any]:
        """One process, the whole GPT: losses, gradient norms, final parameters, validation loss, predictions."""
        model, recorder, logged, val, predictions = _train(devices, "auto", **kwargs)
        suffix = "_accumulate" if kwargs else ""
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{workdir}/reference{suffix}.pt")
        torch.save(predictions, f"{workdir}/predictions{suffix}.pt")
        return {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "logged": logged.values, "val_loss": val}

    return run


def _pipeline(
    schedule: str, dp: int = 1, options: dict[str, Any] | None = None, **kwargs: Any
) -> Callable[[int, str], dict[str, Any]]:
    def run(devices: int, workdir: str) -> dict[str, Any]:
        strategy = PipelineStrategy(schedule=schedule, data_parallel_shard_size=dp, **(options or {}))
        model, recorder, logged, val, predictions = _train(devices, strategy, dp, **kwargs)
        suffix = "_accumulate" if kwargs else ""
        expected = torch.load(f"{workdir}/reference{suffix}.pt")
        local = {k: _full(v.detach()) for k, v in model.state_dict().items()}
        result: dict[str, Any] = {
            "losses": recorder.losses,
            "logged": logged.values,
            "val_loss": val,
            "keys": sorted(local),
            "param_diff": max((local[k] - expected[k]).abs().max().item() for k in local),
            "has_predictions": predictions[0] is not None,
        }
        if predictions[0] is not None:
            ref = torch.load(f"{workdir}/predictions{suffix}.pt")
            result["predictions_equal"] = all(torch.equal(a, b) for a, b in zip(predictions, ref))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return {"per_rank": gathered}

    return run


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "reference": _reference(),
    "reference_accumulate": _reference(accumulate_grad_batches=2),
    "1f1b": _pipeline("1f1b"),
    "gpipe": _pipeline("gpipe"),
    "interleaved_1f1b": _pipeline("interleaved_1f1b"),
    "zbv_zero_bubble": _pipeline("zbv_zero_bubble"),
    "1f1b_accumulate": _pipeline("1f1b", accumulate_grad_batches=2),
    "1f1b_dp2": _pipeline("1f1b", dp=2),  # 4 processes: pp=2 × dp_shard=2
    "1f1b_checkpointing": _pipeline("1f1b", options={"activation_checkpointing": True}),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
