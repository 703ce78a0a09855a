"""Logged training metrics under pipeline parallelism against one process: a torchmetrics ``Metric`` and a plain
tensor logged per step and per epoch (``on_step=True, on_epoch=True, sync_dist=True``) over one whole epoch; and
under context parallel.

python tests/scenarios/metric_log_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
python tests/scenarios/metric_log_runs.py --devices 2 --out r.json --workdir DIR --scenarios gpipe,1f1b,hybrid3d_pp2,context_parallel
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torchmetrics
from common import make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback

from lightning_dist import ContextParallelStrategy, Hybrid3DStrategy, PipelineStrategy

TRAIN_SAMPLES = 32  # one epoch: 4 steps of the global batch of 8
KEYS = ("train_acc", "train_hits")


def _with_train_metrics(model: L.LightningModule) -> L.LightningModule:
    """The example GPT, also logging its training accuracy as a Metric and as a plain tensor."""
    model.train_accuracy = torchmetrics.classification.MulticlassAccuracy(
        num_classes=model.hparams.vocab_size, average="micro"
    )

    def training_step(batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, logits = model._loss(batch)
        predicted, labels = logits.argmax(-1).flatten(), batch["labels"].flatten()
        model.train_accuracy(predicted, labels)
        model.log("train_acc", model.train_accuracy, on_step=True, on_epoch=True, sync_dist=True)
        hits = (predicted == labels).to(torch.float64).mean()
        model.log("train_hits", hits, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, logits = model._loss(batch)
        model.val_accuracy(logits.argmax(-1).flatten(), batch["labels"].flatten())
        model.log("val_acc", model.val_accuracy, on_step=True, on_epoch=True)

    model.training_step, model.validation_step = training_step, validation_step
    return model


class StepValues(Callback):
    """The per-step values logged at every training batch."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {k: [] for k in KEYS}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        for key in KEYS:
            self.values[key].append(float(trainer.callback_metrics[f"{key}_step"]))

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # the value Lightning logs as val_acc_step (Lightning keeps eval step values out of callback_metrics)
        self.values.setdefault("val_acc", []).append(float(pl_module.val_accuracy._forward_cache))


def _run(strategy: Any) -> Callable[[int, str], dict[str, Any]]:
    def run(devices: int, workdir: str) -> dict[str, Any]:
        model, data = make_model_and_data(devices, dp_size=1, n_layer=4, train_samples=TRAIN_SAMPLES)
        steps = StepValues()
        trainer = L.Trainer(
            **trainer_kwargs(
                devices, strategy=strategy() if devices > 1 else "auto", precision="64-true", limit_val_batches=2
            ),
            max_epochs=1,
            callbacks=[steps],
        )
        trainer.fit(_with_train_metrics(model), data)
        epoch = {k: float(trainer.callback_metrics[f"{k}_epoch"]) for k in KEYS}
        epoch["val_acc"] = float(trainer.validate(model, data.val_dataloader(), verbose=False)[0]["val_acc_epoch"])
        return {"steps": steps.values, "epoch": epoch}

    return run


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "reference": _run(lambda: None),
    "gpipe": _run(lambda: PipelineStrategy(schedule="gpipe")),
    "1f1b": _run(lambda: PipelineStrategy(schedule="1f1b")),
    "interleaved_1f1b": _run(lambda: PipelineStrategy(schedule="interleaved_1f1b")),
    "hybrid3d_pp2": _run(lambda: Hybrid3DStrategy(pipeline_parallel_size=2)),
    # context parallel: the epoch values and synced plain values are the whole batch's; a Metric's step value is
    # this rank's sequence shard's, as under DDP it is this rank's samples'
    "context_parallel": _run(lambda: ContextParallelStrategy()),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
