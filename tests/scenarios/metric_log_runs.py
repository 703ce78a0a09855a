"""Logged training metrics under pipeline parallelism against one process: a torchmetrics ``Metric`` and a plain
tensor logged per step and per epoch (``on_step=True, on_epoch=True, sync_dist=True``) over one whole epoch, and
values logged with ``reduce_fx`` sum (a token count, a sample count), max and min, in training and validation; and
under context parallel, where a synced sample count is counted once per cp rank unless it is synced over the
strategy's ``data_parallel_group`` (and warns).

python tests/scenarios/metric_log_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
python tests/scenarios/metric_log_runs.py --devices 2 --out r.json --workdir DIR --scenarios gpipe,1f1b,hybrid3d_pp2,context_parallel
python tests/scenarios/metric_log_runs.py --devices 4 --out r.json --workdir DIR --scenarios hybrid3d_pp2_dp2
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torchmetrics
from common import make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback

from lightning_dist import ContextParallelStrategy, Hybrid3DStrategy, PipelineStrategy, TensorParallelStrategy

TRAIN_SAMPLES = 32  # one epoch: 4 steps of the global batch of 8
SUMS = ("train_tokens", "train_samples", "train_samples_default")  # reduce_fx="sum"
KEYS = ("train_acc", "train_hits", *SUMS, "train_logit_max", "train_logit_min")


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
        _log_counts_and_extremes(model, "train", batch, logits, on_step=True, on_epoch=True)
        return loss

    def validation_step(batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        _, logits = model._loss(batch)
        model.val_accuracy(logits.argmax(-1).flatten(), batch["labels"].flatten())
        model.log("val_acc", model.val_accuracy, on_step=True, on_epoch=True)
        _log_counts_and_extremes(model, "val", batch, logits, on_epoch=True)

    model.training_step, model.validation_step = training_step, validation_step
    return model


def _log_counts_and_extremes(
    model: L.LightningModule, stage: str, batch: dict[str, torch.Tensor], logits: torch.Tensor, **when: bool
) -> None:
    """Sums, a max and a min, as users log them: the tokens (per token: each context-parallel rank counts its shard),
    the samples synced over the data-parallel ranks (the remedy the context-parallel warning gives) and over the
    default group, and the logits' extremes."""
    data_parallel = getattr(model.trainer.strategy, "data_parallel_group", None)
    tokens = (batch["labels"] != -100).sum().to(torch.float64)
    samples = float(batch["input_ids"].shape[0])
    model.log(f"{stage}_tokens", tokens, sync_dist=True, reduce_fx="sum", **when)
    model.log(f"{stage}_samples", samples, sync_dist=True, reduce_fx="sum", sync_dist_group=data_parallel, **when)
    model.log(f"{stage}_samples_default", samples, sync_dist=True, reduce_fx="sum", **when)
    model.log(f"{stage}_logit_max", logits.detach().max(), sync_dist=True, reduce_fx="max", **when)
    model.log(f"{stage}_logit_min", logits.detach().min(), sync_dist=True, reduce_fx=torch.min, **when)


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


def _run(strategy: Any, dp: int = 1) -> Callable[[int, str], dict[str, Any]]:
    def run(devices: int, workdir: str) -> dict[str, Any]:
        model, data = make_model_and_data(devices, dp_size=dp, n_layer=4, train_samples=TRAIN_SAMPLES, vocab_size=64)
        steps = StepValues()
        trainer = L.Trainer(
            **trainer_kwargs(
                devices, strategy=strategy() if devices > 1 else "auto", precision="64-true", limit_val_batches=2
            ),
            max_epochs=1,
            callbacks=[steps],
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_with_train_metrics(model), data)
            epoch = {k: float(trainer.callback_metrics[f"{k}_epoch"]) for k in KEYS}
            fit_val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
            validated = trainer.validate(model, data.val_dataloader(), verbose=False)[0]
        epoch.update({k.removesuffix("_epoch"): float(v) for k, v in validated.items()})
        warned = [str(w.message) for w in caught if "context_parallel: self.log(" in str(w.message)]
        return {"steps": steps.values, "epoch": epoch, "fit_val": fit_val, "warned": warned}

    return run


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "reference": _run(lambda: None),
    "gpipe": _run(lambda: PipelineStrategy(schedule="gpipe")),
    "1f1b": _run(lambda: PipelineStrategy(schedule="1f1b", n_microbatches=4)),
    "interleaved_1f1b": _run(lambda: PipelineStrategy(schedule="interleaved_1f1b")),
    "hybrid3d_pp2": _run(lambda: Hybrid3DStrategy(pipeline_parallel_size=2)),
    "hybrid3d_pp2_dp2": _run(lambda: Hybrid3DStrategy(
        pipeline_parallel_size=2, data_parallel_shard_size=2, n_microbatches=4), dp=2),
    # context parallel: the epoch values and synced plain values are the whole batch's; a Metric's step value is
    # this rank's sequence shard's, as under DDP it is this rank's samples'
    "context_parallel": _run(lambda: ContextParallelStrategy()),
    # tensor parallel: the tp peers see the same samples and are not in the loss group: sums are one process's
    "tensor_parallel": _run(lambda: TensorParallelStrategy(tensor_parallel_size=2)),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
