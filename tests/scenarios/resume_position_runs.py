"""Where a resumed run starts in its data, for every way a checkpoint is made.

One launch runs, per strategy and in sequence: the uninterrupted reference (12 optimizer steps, 3 epochs of 4 batches,
with ModelCheckpoints every 3 steps, at train-epoch end and at validation end), three fits that stop and then call
``trainer.save_checkpoint`` (max_steps mid-epoch, max_steps at the epoch boundary, max_epochs), and then the resume
from each of those checkpoints (each in the same processes, a fresh Trainer and model). Lightning's injected
DistributedSampler shuffles, so each epoch has its own order: a resume that starts in the wrong epoch, or at the wrong
batch of the right one, trains on other samples and its losses differ from the reference's.

The LR schedule is fixed at 12 steps whatever ``max_steps`` is, so the interrupted fits follow the reference exactly.

python tests/scenarios/resume_position_runs.py --devices 2 --out r.json --workdir DIR --scenarios fsdp2,pipeline
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from common import StepRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_dist
from examples.gpt import GPT

STEPS = 12
STEPS_PER_EPOCH = 4
EPOCH_SAMPLES = 32  # global batch 8 → 4 steps per epoch
VOCAB = 64  # the data has 63 token ids; 64 lets tensor parallelism divide the vocabulary

# strategy name → (strategy on 2 ranks, its data-parallel size)
STRATEGIES: dict[str, tuple[Callable[[], Any], int]] = {
    "fsdp2": (lambda: lightning_dist.FSDP2Strategy(), 2),
    "pipeline": (lambda: lightning_dist.PipelineStrategy(), 1),
    "tensor_parallel": (lambda: lightning_dist.TensorParallelStrategy(tensor_parallel_size=2), 1),
}

BY_STEPS = {"max_steps": STEPS}
BY_EPOCHS = {"max_epochs": STEPS // STEPS_PER_EPOCH}
# resume name → (the checkpoint, written by the reference or a stopped fit; the reference step it holds; how the
# resumed fit is told to stop: max_steps is iteration-based training to Lightning, max_epochs is not)
RESUMES: dict[str, tuple[str, int, dict[str, int]]] = {
    "after_fit_max_steps_mid_epoch": ("stopped_mid/after_fit.ckpt", 3, BY_STEPS),
    "after_fit_max_steps_mid_epoch_by_epochs": ("stopped_mid/after_fit.ckpt", 3, BY_EPOCHS),
    "after_fit_max_steps_epoch_end": ("stopped_boundary/after_fit.ckpt", 4, BY_STEPS),
    "after_fit_max_epochs": ("stopped_epochs/after_fit.ckpt", 4, BY_EPOCHS),
    "after_fit_max_epochs_by_steps": ("stopped_epochs/after_fit.ckpt", 4, BY_STEPS),
    "train_epoch_end_of_a_cut_short_epoch": ("stopped_mid/train_epoch_end-step=3.ckpt", 3, BY_STEPS),
    "every_3_steps_mid_epoch": ("reference/every-step=3.ckpt", 3, BY_STEPS),
    "every_3_steps_second_epoch": ("reference/every-step=6.ckpt", 6, BY_STEPS),
    "every_4_steps_epoch_end": ("reference/every4-step=4.ckpt", 4, BY_STEPS),
    "train_epoch_end": ("reference/train_epoch_end-step=4.ckpt", 4, BY_STEPS),
    "validation_end": ("reference/validation_end-step=8.ckpt", 8, BY_STEPS),
    "validation_end_by_epochs": ("reference/validation_end-step=4.ckpt", 4, BY_EPOCHS),
}
# Every strategy saves and resumes through the same code (MeshParallelStrategy): fsdp2 runs every case, the others
# one of each kind (cut short, epoch finished, Lightning's own mid-epoch save) to keep the launch short.
SUBSET = ["after_fit_max_steps_mid_epoch", "after_fit_max_steps_epoch_end", "train_epoch_end", "validation_end",
          "every_3_steps_mid_epoch"]  # fmt: skip
CASES: dict[str, list[str]] = {"fsdp2": list(RESUMES), "pipeline": SUBSET, "tensor_parallel": SUBSET}
# stopped fit → how it stops (each then calls trainer.save_checkpoint into <name>/after_fit.ckpt)
STOPPED_FITS: dict[str, dict[str, int]] = {
    "stopped_mid": {"max_steps": 3},  # also saves at train-epoch end: Lightning runs those hooks at the stop
    "stopped_boundary": {"max_steps": 4},
    "stopped_epochs": {"max_epochs": 1},
}


class FixedScheduleGPT(GPT):
    """The example GPT with its LR schedule's length fixed at STEPS (it follows ``max_steps`` otherwise)."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

        def schedule(step: int) -> float:
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step / STEPS, 1.0)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class BatchRecorder(Callback):
    """Per training step: the epoch and batch index Lightning reports, and a fingerprint of this rank's batch."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        fingerprint = hash(tuple(batch["input_ids"][:, :8].flatten().tolist())) % 10**6
        self.steps.append([trainer.current_epoch, idx, fingerprint])


def _fit(strategy: str, callbacks: list[Callback], resume: str | None = None, **stop: int) -> dict:
    make, dp = STRATEGIES[strategy]
    _, data = make_model_and_data(2, dp, train_samples=EPOCH_SAMPLES, vocab_size=VOCAB)
    L.seed_everything(1234, verbose=False)
    model = FixedScheduleGPT(
        vocab_size=VOCAB, seq_len=data.seq_len, d_model=32, n_layer=2, n_head=4, lr=1e-2, warmup_steps=0
    )
    recorder, batches = StepRecorder(), BatchRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(2, strategy=make(), precision="32-true", enable_checkpointing=True),
        callbacks=[recorder, batches, *callbacks],
        **stop,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path=resume)
    return {
        "losses": recorder.losses,
        "steps": batches.steps,
        "global_step": trainer.global_step,
        "warnings": [str(w.message) for w in caught if any(s in str(w.message) for s in ("skip", "ended before"))],
        "trainer": trainer,
    }


def _checkpoint(folder: str, name: str, **kwargs: Any) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, filename=f"{name}-{{step}}", save_top_k=-1, **kwargs)


def _reference_checkpoints(folder: str) -> list[Callback]:
    return [
        _checkpoint(folder, "every", every_n_train_steps=3),
        _checkpoint(folder, "every4", every_n_train_steps=4),
        _checkpoint(folder, "train_epoch_end", every_n_epochs=1, save_on_train_epoch_end=True),
        _checkpoint(folder, "validation_end", every_n_epochs=1, mode="max"),  # mode: a state key of its own
    ]


def resume_positions(strategy: str, devices: int, workdir: str) -> dict[str, Any]:
    """The reference, the stopped fits, and a resume from every checkpoint, under ``strategy`` on 2 ranks."""
    root = f"{workdir}/{strategy}"
    result: dict[str, Any] = {}
    reference = _fit(strategy, _reference_checkpoints(f"{root}/reference"), max_steps=STEPS)
    reference.pop("trainer")
    result["reference"] = reference
    cases = CASES[strategy]
    for name, stop in STOPPED_FITS.items():
        if not any(RESUMES[case][0].startswith(f"{name}/") for case in cases):
            continue
        epoch_end = _checkpoint(f"{root}/{name}", "train_epoch_end", every_n_epochs=1, save_on_train_epoch_end=True)
        run = _fit(strategy, [epoch_end], **stop)
        run.pop("trainer").save_checkpoint(f"{root}/{name}/after_fit.ckpt")
        result[name] = run
    for name in cases:
        path, _, stop = RESUMES[name]
        run = _fit(strategy, [], resume=f"{root}/{path}", **stop)
        run.pop("trainer")
        result[f"resume_{name}"] = run
    return result


SCENARIOS = {name: (lambda d, w, s=name: resume_positions(s, d, w)) for name in STRATEGIES}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
