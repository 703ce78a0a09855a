"""Lightning's own tools as users bring them, under the strategies against DDP and one process.

- ``lr_find_*``: ``Tuner(trainer).lr_find(model)`` on a module whose ``configure_optimizers`` returns a bare
  optimizer (the finder's own scheduler adds ``initial_lr`` to its param groups after the finder saved its
  checkpoint), then ``trainer.fit`` with the suggested learning rate on the same Trainer.
- ``callbacks_*``: one fit with ``BackboneFinetuning`` (a param group added when the backbone thaws),
  ``GradientAccumulationScheduler``, ``ReduceLROnPlateau`` on the validation loss, ``EarlyStopping``,
  ``LearningRateMonitor`` and ``ModelCheckpoint(monitor=..., save_top_k=2)``, then ``trainer.test(ckpt_path="best")``.
- ``sync_batchnorm_*``: ``Trainer(sync_batchnorm=True)`` on a model with BatchNorm.
- ``anomaly_*``: ``Trainer(detect_anomaly=True)``, on the example GPT (``anomaly_<strategy>``) and on one whose
  backward makes a NaN (``anomaly_nan_<strategy>``, run to its failure).

python tests/scenarios/lightning_tools_runs.py --devices 2 --out r.json --workdir DIR --scenarios lr_find_fsdp2,lr_find_ddp
python tests/scenarios/lightning_tools_runs.py --devices 1 --out ref.json --workdir DIR --scenarios lr_find_one_process
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from common import ALL_RANKS, StepRecorder, full_state, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    Callback,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
)
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner

from examples.gpt import GPT
from lightning_dist import FSDP2Strategy, PipelineStrategy, TensorParallelStrategy, ZeroPPStrategy

FIT_STEPS = 3
FINDER_STEPS = 16


class BareOptimizerGPT(GPT):
    """The example GPT with the optimizer users write for ``lr_find``: no scheduler of its own."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def _lr_find(devices: int, workdir: str, name: str, strategy: Any, dp: int) -> dict[str, Any]:
    model, data = make_model_and_data(devices, dp_size=dp, vocab_size=64)
    model = BareOptimizerGPT(**dict(model.hparams)).double()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = StepRecorder()
    root = os.path.join(workdir, name)
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true"),
        max_steps=FIT_STEPS,
        callbacks=[recorder],
        default_root_dir=root,
    )
    finder = Tuner(trainer).lr_find(
        model, datamodule=data, min_lr=1e-5, max_lr=1.0, num_training=FINDER_STEPS, early_stop_threshold=None
    )
    restored = full_state(trainer.lightning_module)  # the finder restores the weights it started from
    restored_gap = max(float((restored[k] - initial[k]).abs().max()) for k in restored)
    left_behind = [f for f in os.listdir(root) if f.startswith(".lr_find")] if os.path.isdir(root) else []
    trainer.fit(model, datamodule=data)
    return {
        "lrs": finder.results["lr"],
        "losses": finder.results["loss"],
        "suggestion": finder.suggestion(),
        "hparams_lr": float(model.hparams.lr),
        "restored_gap": restored_gap,
        "left_behind": left_behind,
        "fit_losses": recorder.losses,
    }


class FinetuningGPT(GPT):
    """The example GPT as a BackboneFinetuning user writes it: a ``backbone``, an optimizer over what is trainable
    and a plateau scheduler on the validation loss (its threshold makes it halve the rates at every epoch's end)."""

    @property
    def backbone(self) -> torch.nn.Module:
        return self.blocks

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


def _callbacks(devices: int, workdir: str, name: str, strategy: Any, dp: int) -> dict[str, Any]:
    model, data = make_model_and_data(devices, dp_size=dp, vocab_size=64)
    model = FinetuningGPT(**dict(model.hparams)).double()
    recorder = StepRecorder()
    best = ModelCheckpoint(dirpath=os.path.join(workdir, name, "checkpoints"), monitor="val_loss", save_top_k=2)
    trainer = L.Trainer(
        **trainer_kwargs(
            devices,
            strategy=strategy,
            precision="64-true",
            enable_checkpointing=True,
            logger=CSVLogger(os.path.join(workdir, name)),
        ),
        max_epochs=3,
        limit_train_batches=4,
        callbacks=[
            recorder,
            BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5),
            GradientAccumulationScheduler({0: 1, 2: 2}),
            EarlyStopping("val_loss", patience=5),
            LearningRateMonitor(),
            best,
        ],
    )
    trainer.fit(model, datamodule=data)
    optimizer = trainer.optimizers[0]
    tested = trainer.test(model, datamodule=data, ckpt_path="best", verbose=False)
    return {
        "losses": recorder.losses,
        "grad_norms": recorder.grad_norms,
        "group_sizes": [len(group["params"]) for group in optimizer.param_groups],
        "lrs": [float(group["lr"]) for group in optimizer.param_groups],
        "best_score": float(best.best_model_score),
        "best_name": os.path.basename(best.best_model_path),
        "kept": sorted(os.listdir(best.dirpath)),
        "test_loss": tested[0]["test_loss"],
    }


class BatchNormNet(L.LightningModule):
    """A small convolutional classifier with BatchNorm, as vision users write one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv1d(4, 8, 3, padding=1),
            torch.nn.BatchNorm1d(8),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 16, 3),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class BatchNormKinds(Callback):
    """The normalization layers (synced or not) and their process group's size when the fit starts."""

    def __init__(self) -> None:
        self.kinds: list[tuple[str, int]] = []

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for module in pl_module.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                group = getattr(module, "process_group", None)
                kind = "SyncBatchNorm" if isinstance(module, torch.nn.SyncBatchNorm) else "BatchNorm"
                self.kinds.append((kind, group.size() if group is not None else 0))


def _sync_batchnorm(devices: int, workdir: str, name: str, strategy: Any, dp: int, sync: bool = True) -> dict[str, Any]:
    """``Trainer(sync_batchnorm=True)``: the layers the fit starts with, and how the first step ends. On the CPU,
    torch's SyncBatchNorm refuses the forward (it syncs on accelerators only) under DDP and the mesh strategies alike."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, 16), torch.randint(0, 3, (16,)))
    kinds = BatchNormKinds()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy), sync_batchnorm=sync, max_steps=1, callbacks=[kinds]
    )
    try:
        trainer.fit(BatchNormNet(), torch.utils.data.DataLoader(data, batch_size=4))
        error = None
    except ValueError as err:
        error = str(err)
    return {"kinds": kinds.kinds, "error": error}


class NaNBackwardGPT(GPT):
    """The example GPT plus a term whose backward is NaN (``sqrt``'s at 0, times 0) and whose value is 0."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + 0.0 * torch.sqrt(loss * 0.0)


def _anomaly(devices: int, workdir: str, name: str, strategy: Any, dp: int, nan: bool = False) -> dict[str, Any]:
    """``Trainer(detect_anomaly=True)``: three steps' losses, fp64 (``nan``: the module whose backward is NaN)."""
    model, data = make_model_and_data(devices, dp_size=dp, vocab_size=64)
    if nan:
        model = NaNBackwardGPT(**dict(model.hparams))
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true"),
        detect_anomaly=True,
        max_steps=FIT_STEPS,
        callbacks=[recorder],
    )
    trainer.fit(model.double(), datamodule=data)
    return {"losses": recorder.losses}


def _each(run: Callable[..., dict[str, Any]], kind: str) -> dict[str, Callable[[int, str], dict[str, Any]]]:
    """``run`` under each strategy, as ``<kind>_<strategy>``."""
    strategies: dict[str, tuple[Callable[[int], Any], bool]] = {  # (strategy for d devices, whether dp = d)
        "fsdp2": ALL_RANKS["fsdp2"],
        "zeropp": (
            lambda d: ZeroPPStrategy(quantized_weights=False, quantized_gradients=False, ranks_per_node=1),
            True,
        ),
        "ddp": (lambda d: "ddp", True),
        "tensor_parallel": ALL_RANKS["tensor_parallel"],
        "one_process": ALL_RANKS["one_process"],
    }
    return {
        f"{kind}_{name}": (
            lambda d, w, name=name, make=make, dp_all=dp_all: run(d, w, f"{kind}_{name}", make(d), d if dp_all else 1)
        )
        for name, (make, dp_all) in strategies.items()
    }


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    **_each(_lr_find, "lr_find"),
    "lr_find_pipeline": lambda d, w: _lr_find(d, w, "lr_find_pipeline", PipelineStrategy(pipeline_parallel_size=d), 1),
    **_each(_callbacks, "callbacks"),
    **{k: v for k, v in _each(_sync_batchnorm, "sync_batchnorm").items() if "tensor_parallel" not in k},
    "batchnorm_fsdp2": lambda d, w: _sync_batchnorm(d, w, "batchnorm_fsdp2", FSDP2Strategy(), d, sync=False),
    **{k: v for k, v in _each(_anomaly, "anomaly").items() if k.endswith(("tensor_parallel", "one_process"))},
    "anomaly_pipeline": lambda d, w: _anomaly(d, w, "anomaly_pipeline", PipelineStrategy(pipeline_parallel_size=d), 1),
    "anomaly_nan_tensor_parallel": lambda d, w: _anomaly(
        d, w, "anomaly_nan_tensor_parallel", TensorParallelStrategy(tensor_parallel_size=d), 1, nan=True
    ),
    "anomaly_nan_pipeline": lambda d, w: _anomaly(
        d, w, "anomaly_nan_pipeline", PipelineStrategy(pipeline_parallel_size=d), 1, nan=True
    ),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
