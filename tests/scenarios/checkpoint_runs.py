"""Checkpoint scenarios: exact resume for each checkpoint IO plugin, async ordering, resharding, cross-strategy
resume and a save killed midway.

Each scenario is one Trainer in the launched processes; a resume always runs in a later launch (new processes).
Runs are 6 optimizer steps over 4-step epochs, checkpointed every 3 steps: the step-3 checkpoint is mid-epoch (the
dataloader position and the LR warm-up schedule must be restored) and the resumed run crosses an epoch boundary.

python tests/scenarios/checkpoint_runs.py --devices 2 --out r.json --workdir DIR --scenarios fit_dcp_fp32,...
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import (  # type: ignore[import-not-found]
    StepRecorder,
    is_rank_zero,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.checkpoint import FileSystemWriter

import lightning_dist
from lightning_dist import AsyncDistributedCheckpointIO, DistributedCheckpointIO, FullStateCheckpointIO

STEPS = 6
SAVE_EVERY = 3
EPOCH_SAMPLES = 32  # global batch 8 → 4 steps per epoch
STEPS_PER_EPOCH = 4
PROBE_SEED = 99

PLUGINS: dict[str, Callable[[], Any]] = {
    "dcp": DistributedCheckpointIO,
    "async": AsyncDistributedCheckpointIO,
    "full": FullStateCheckpointIO,
}


@dataclass(frozen=True)
class StrategySpec:
    """How a strategy runs on ``devices`` ranks: the strategy object and its data-parallel size (the sampler's
    replicas; the global batch stays GLOBAL_BATCH whatever the mesh)."""

    make: Callable[[int], Any]
    dp: Callable[[int], int] = lambda devices: devices


# Strategies a checkpoint is saved with and resumed under (the test lists which pairs run). A new strategy joins by
# adding a line here: pipeline and hybrid3d next.
STRATEGIES: dict[str, StrategySpec] = {
    "fsdp2": StrategySpec(lambda d: lightning_dist.FSDP2Strategy()),
    # tp=2; on 4 ranks 2D: 2 data-parallel replicas × tp=2
    "tensor_parallel": StrategySpec(
        lambda d: lightning_dist.TensorParallelStrategy(tensor_parallel_size=2, data_parallel_shard_size=d // 2),
        dp=lambda d: d // 2,
    ),
    # the lossless ZeRO++ technique (hpZ over 2 simulated nodes × 2 ranks), so trajectories compare to 1e-10
    "zeropp_hpz": StrategySpec(
        lambda d: lightning_dist.ZeroPPStrategy(quantized_weights=False, quantized_gradients=False, ranks_per_node=2)
    ),
    "one_device": StrategySpec(lambda d: "auto"),
}
VOCAB = 64  # the data has 63 token ids; 64 lets tp divide the vocabulary (the same model under every strategy)


def probe_input(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(PROBE_SEED))


class ForwardProbe(Callback):
    """Records the model's output on a fixed input at the end of fit (every rank runs it; rank 0 keeps it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        was_training = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            out = pl_module(probe_input(pl_module.hparams.vocab_size))
        pl_module.train(was_training)
        if is_rank_zero():
            torch.save(out.detach().cpu(), self.path)


def fit(
    devices: int,
    workdir: str,
    name: str,
    precision: str,
    plugin: str | None = "dcp",
    strategy: str = "fsdp2",
    resume_from: str | None = None,
    extra_callbacks: list[Callback] | None = None,
    checkpoint_io: Any = None,
) -> dict[str, Any]:
    """Fit to step STEPS under ``strategy``, checkpointing every SAVE_EVERY steps into ``workdir/name``."""
    spec = STRATEGIES[strategy]
    model, data = make_model_and_data(devices, spec.dp(devices), train_samples=EPOCH_SAMPLES, vocab_size=VOCAB)
    recorder = StepRecorder()
    ckpt = ModelCheckpoint(
        dirpath=f"{workdir}/{name}", every_n_train_steps=SAVE_EVERY, save_top_k=-1, filename="{step}"
    )
    io = checkpoint_io if checkpoint_io is not None else PLUGINS[plugin]() if plugin else None
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=spec.make(devices), precision=precision, enable_checkpointing=True),
        max_steps=STEPS,
        callbacks=[recorder, ckpt, ForwardProbe(f"{workdir}/{name}_probe.pt"), *(extra_callbacks or [])],
        plugins=[io] if io is not None else None,
    )
    trainer.fit(model, data, ckpt_path=resume_from)
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    return {"losses": recorder.losses, "global_step": trainer.global_step, "final_lr": lr}


# ---------------------------------------------------------------------------------------------- async ordering
class _Events:
    """Cross-thread, cross-rank event log in a file (rank 0's view is what the test reads)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def add(self, event: str) -> None:
        if is_rank_zero():
            with self.path.open("a") as f:
                f.write(f"{event}\n")


class _BlockedWriter(FileSystemWriter):
    """Writes only once the training loop has started the step after the save (or fails after a timeout): if the
    save were synchronous, training could never start that step and this writer would time out."""

    def __init__(self, path: Path, release: Path, events: _Events) -> None:
        super().__init__(path)
        self.release = release
        self.events = events

    def write_data(self, plan: Any, planner: Any) -> Any:
        deadline = time.monotonic() + 120
        while not self.release.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the training loop never started the next step while the save was in flight")
            time.sleep(0.01)
        result = super().write_data(plan, planner)
        self.events.add("write_finished")
        return result


class _OrderedAsyncIO(AsyncDistributedCheckpointIO):
    def __init__(self, release: Path, events: _Events) -> None:
        super().__init__()
        self.release = release
        self.events = events
        self.saves = 0

    def _storage_writer(self, folder: Path) -> FileSystemWriter:
        self.saves += 1
        if self.saves == 1:  # only the first save is held back
            return _BlockedWriter(folder, self.release, self.events)
        return super()._storage_writer(folder)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.events.add(f"save_returned step={checkpoint['global_step']}")


class _StepStarts(Callback):
    def __init__(self, release: Path, events: _Events) -> None:
        self.release = release
        self.events = events

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.events.add(f"step_started step={trainer.global_step + 1}")
        if trainer.global_step >= SAVE_EVERY and is_rank_zero():
            self.release.touch()


def async_ordering(devices: int, workdir: str) -> dict[str, Any]:
    release = Path(workdir) / "async_release"
    events = _Events(f"{workdir}/async_events.txt")
    result = fit(
        devices,
        workdir,
        "async_fp32",
        "32-true",
        checkpoint_io=_OrderedAsyncIO(release, events),
        extra_callbacks=[_StepStarts(release, events)],
    )
    result["events"] = Path(events.path).read_text().splitlines() if is_rank_zero() else []
    return result


# ---------------------------------------------------------------------------------------------- crash mid-save
def crash_during_save(devices: int, workdir: str) -> dict[str, Any]:
    """Checkpoint every 2 steps with ``last``; the last rank dies inside its shard write of the step-4 save."""
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    writes = {"count": 0}
    original = FileSystemWriter.write_data

    def dying_write(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        writes["count"] += 1
        if rank == devices - 1 and writes["count"] == 3:  # step 2: "step=2" and "last"; step 4: dies here
            (Path(self.path) / "partial_shard_of_a_dying_rank").write_bytes(b"\0" * 1024)
            os._exit(17)
        return original(self, plan, planner)

    FileSystemWriter.write_data = dying_write  # type: ignore[method-assign]
    model, data = make_model_and_data(devices, train_samples=EPOCH_SAMPLES, vocab_size=VOCAB)
    ckpt = ModelCheckpoint(
        dirpath=f"{workdir}/crash", every_n_train_steps=2, save_top_k=-1, save_last=True, filename="{step}"
    )
    trainer = L.Trainer(
        **trainer_kwargs(
            devices,
            strategy=lightning_dist.FSDP2Strategy(timeout=timedelta(seconds=60)),
            precision="32-true",
            enable_checkpointing=True,
        ),
        max_steps=STEPS,
        callbacks=[ckpt],
    )
    trainer.fit(model, data)
    return {"error": "the injected crash did not happen"}


# ---------------------------------------------------------------------------------------------- the table
def _epoch_end_checkpoint(dirpath: str) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=dirpath, every_n_train_steps=STEPS_PER_EPOCH, save_top_k=-1, filename="epoch_end-{step}"
    )


def _ckpt(workdir: str, name: str, step: int = SAVE_EVERY) -> str:
    return f"{workdir}/{name}/step={step}.ckpt"


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    # fp32, same world size: exact resume for each plugin
    "fit_dcp_fp32": lambda d, w: fit(
        d, w, "dcp_fp32", "32-true", plugin="dcp", extra_callbacks=[_epoch_end_checkpoint(f"{w}/dcp_fp32")]
    ),
    "fit_async_fp32": async_ordering,  # also shows that training goes on while the first save is being written
    "fit_full_fp32": lambda d, w: fit(
        d, w, "full_fp32", "32-true", plugin="full", extra_callbacks=[_epoch_end_checkpoint(f"{w}/full_fp32")]
    ),
    "crash_during_save": crash_during_save,
    "resume_after_crash": lambda d, w: fit(d, w, "after_crash", "32-true", resume_from=f"{w}/crash/last.ckpt"),
    # a plain one-device Lightning run (no lightning_dist strategy or plugin) resumes the one-file checkpoint, and the
    # sharded folder itself (Lightning's TorchCheckpointIO reads it: plugins/folder_loading.py); at an epoch
    # boundary, as Lightning itself restores no mid-epoch data position
    **{
        f"resume_{p}_fp32_one_device": lambda d, w, p=p: fit(
            d,
            w,
            f"{p}_one_device",
            "32-true",
            plugin=None,
            strategy="one_device",
            resume_from=f"{w}/{p}_fp32/epoch_end-step={STEPS_PER_EPOCH}.ckpt",
        )
        for p in ("full", "dcp")
    },
}
for _p in PLUGINS:
    SCENARIOS[f"resume_{_p}_fp32"] = lambda d, w, p=_p: fit(
        d, w, f"{p}_fp32_resumed", "32-true", plugin=p, resume_from=_ckpt(w, f"{p}_fp32")
    )
# fp64: resharding (N → M ranks) and cross-strategy resume, named fit_<strategy>_d<N> and
# resume_<strategy>_d<N>_as_<strategy>_d<M> (run with M processes)
for _s in STRATEGIES:
    SCENARIOS[f"fit_{_s}_fp64"] = lambda d, w, s=_s: fit(d, w, f"{s}_fp64_d{d}", "64-true", strategy=s)
    for _n in (2, 4):
        for _t in STRATEGIES:
            SCENARIOS[f"resume_{_s}_d{_n}_as_{_t}"] = lambda d, w, s=_s, n=_n, t=_t: fit(
                d, w, f"{s}_d{n}_as_{t}_d{d}", "64-true", strategy=t, resume_from=_ckpt(w, f"{s}_fp64_d{n}")
            )


if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
