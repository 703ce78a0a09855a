"""Replica groups under torchft (each group one Lightning job of ``--devices`` processes, launched by
``benchmarks/common/replica_groups.py`` with its group id, the lighthouse and its own ``MASTER_PORT`` in the
environment), and the plain HSDP run they must equal.

- ``hsdp``: one job of 4 processes, ``data_parallel_replicate_size=2`` (the reference; no fault tolerance), 8 steps
  (one epoch) of :class:`IndexedGPT` in fp64 (its own ``DistributedSampler`` from ``distributed_sampler_kwargs``),
  clipped at ``CLIP``, with ``on_nonfinite="skip"`` (both act after the gradients are averaged across groups):
  the losses, the samples each rank read, the final parameters; ``hsdp_accumulated`` the same with 2 micro-batches
  per optimizer step, and ``accumulated`` that run as one of 2 replica groups without a failure;
- ``chaos``: this job is one of 2 replica groups (``fault_tolerance`` from the environment), the same model for
  ``CHAOS_STEPS`` steps slowed by a sleep (longer while a group trains alone); the orchestrator kills and relaunches
  group 1 mid-run. After 8 steps, before the failure, each group writes what ``hsdp`` records
  (``chaos_early_g<id>.json``); at the end it records each step's wall time, quorum and commits, the time from launch
  to the first committed step, heals and bytes received, and saves this rank's parameter and optimizer-state shards
  for the bitwise comparison. ``CHAOS_MESH=pp2tp2`` runs hybrid3d groups of pp2 × tp2, ``CHAOS_MESH=zeropp`` zeropp
  groups.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import full_state, run_scenario_script, trainer_kwargs
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from user_modules import OwnSamplerGPT

from examples.data import TokenWindows
from lightning_dist import FSDP2Strategy, Hybrid3DStrategy, ZeroPPStrategy
from lightning_dist.parallel.fault_tolerance import local_tensor
from lightning_dist.parallel.grad_clip import total_grad_norm

GLOBAL_BATCH = 8
CLIP = 0.5  # below the gradient norms of the first steps: clipping acts (over the gradients averaged across groups)
SAMPLES = 64  # one epoch = 8 steps of the global batch
# vocab 66 (the text uses 65 tokens): divisible by tp=2 for the hybrid3d variant
MODEL: dict[str, Any] = {"vocab_size": 66, "seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4, "lr": 1e-2}
# the timed runs' model and steps (benchmarks/studies/fault_tolerance_overhead.py)
TIMED_MODEL = {**MODEL, **json.loads(os.environ.get("FT_TIMED_MODEL", "{}"))}
TIMED_STEPS = int(os.environ.get("FT_TIMED_STEPS", "12"))


class IndexedWindows(TokenWindows):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(index), "index": torch.tensor(index)}


class IndexedGPT(OwnSamplerGPT):
    """:class:`OwnSamplerGPT` whose samples carry their index. ``step_sleep`` slows every training step, and
    ``alone_sleep`` the steps a replica group trains without the others (a bigger model's steps, which leave a
    relaunched group, whose start takes 8 to 30 s on 2 busy cores, the time to rejoin before the run ends)."""

    def __init__(self, step_sleep: float = 0.0, alone_sleep: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.train_set = IndexedWindows(self.train_set.tokens, self.train_set.seq_len)
        self.step_sleep = step_sleep
        self.alone_sleep = alone_sleep
        self.read: list[list[int]] = []
        self.slept = 0.0

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.read.append(batch["index"].tolist())
        groups = getattr(self.trainer.strategy, "replica_groups", None)
        alone = groups is not None and groups.quorum_size < groups.options.num_replica_groups
        sleep = self.alone_sleep if alone else self.step_sleep
        self.slept += sleep  # per batch (StepLog resets it): a pipeline calls training_step per micro-batch
        if sleep:
            time.sleep(sleep)
        return super().training_step(batch, batch_idx)


def _model(step_sleep: float = 0.0, alone_sleep: float = 0.0, model: dict[str, Any] = MODEL) -> IndexedGPT:
    L.seed_everything(1234, verbose=False)
    return IndexedGPT(
        global_batch=GLOBAL_BATCH, train_samples=SAMPLES, step_sleep=step_sleep, alone_sleep=alone_sleep, **model
    )


class StepLog(Callback):
    """Per training batch: the global step, its wall time, the group's mean loss; progress in a file the
    orchestrator polls (``FT_PROGRESS``)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.grad_norms: list[float] = []
        self.started = 0.0

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.grad_norms.append(float(total_grad_norm(module.parameters())))  # before clipping

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        self.started = time.time()
        module.slept = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = float(trainer.strategy.reduce(outputs["loss"].detach().clone(), reduce_op="mean"))
        groups = trainer.strategy.replica_groups
        self.rows.append(
            {
                "global_step": trainer.global_step,
                "end": time.time(),
                "seconds": time.time() - self.started,
                "slept": _longest_over_ranks(getattr(module, "slept", 0.0)),
                "loss": loss,
                "committed": groups.committed_steps if groups else None,
                "skipped": groups.skipped_steps if groups else None,
                "quorum": groups.quorum_size if groups else None,
            }
        )
        progress = os.environ.get("FT_PROGRESS")
        if progress and trainer.global_rank == 0:
            Path(progress).write_text(str(trainer.global_step))


class EarlySnapshot(Callback):
    """Once ``steps`` optimizer steps are done (before any failure): the group's losses, the samples each of its
    ranks read and its full parameters, written by rank 0 to ``path`` (the chaos run's group 1 is killed later)."""

    def __init__(self, steps: int, path: Path, log: StepLog) -> None:
        self.steps, self.path, self.step_log = steps, path, log

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.steps or len(self.step_log.rows) != self.steps:
            return
        snapshot = {"losses": [r["loss"] for r in self.step_log.rows], "read": _read_by_all_ranks(module),
                    "grad_norms": self.step_log.grad_norms,
                    "params": {k: v.tolist() for k, v in full_state(module).items()}}  # fmt: skip
        if trainer.global_rank == 0:
            self.path.write_text(json.dumps(snapshot))


def _longest_over_ranks(seconds: float) -> float:
    """The most any rank of the group slept in this batch (under a pipeline only the last stage runs
    ``training_step``, while the first waits for it)."""
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _read_by_all_ranks(module: IndexedGPT) -> list[list[list[int]]]:
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, module.read)
    return gathered


def _fit(
    strategy: Any,
    devices: int,
    steps: int,
    step_sleep: float = 0.0,
    alone_sleep: float = 0.0,
    snapshot: Path | None = None,
    checkpoints: Path | None = None,
    model_options: dict[str, Any] = MODEL,
    **kwargs: Any,
) -> tuple[Any, ...]:
    model = _model(step_sleep, alone_sleep, model_options)
    log = StepLog()
    callbacks: list[Callback] = [log]
    if snapshot is not None:
        callbacks.append(EarlySnapshot(SAMPLES // GLOBAL_BATCH, snapshot, log))
    if checkpoints is not None:  # every group saves into the same folder: only the first live group writes
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=5, save_top_k=-1))
    trainer = L.Trainer(
        **trainer_kwargs(
            devices,
            strategy=strategy,
            precision="64-true",
            use_distributed_sampler=False,
            limit_val_batches=0,
            enable_checkpointing=checkpoints is not None,
            **kwargs,
        ),
        max_steps=steps,
        callbacks=callbacks,
        gradient_clip_val=CLIP,
    )
    trainer.fit(model)
    return model, trainer, log


def hsdp(devices: int, workdir: str, accumulate: int = 1) -> dict[str, Any]:
    strategy = FSDP2Strategy(
        sharding="hybrid", data_parallel_replicate_size=2, data_parallel_shard_size=devices // 2, on_nonfinite="skip"
    )
    model, _trainer, log = _fit(
        strategy, devices, SAMPLES // GLOBAL_BATCH // accumulate, accumulate_grad_batches=accumulate
    )
    return _trained(model, log)


def _trained(model: IndexedGPT, log: StepLog) -> dict[str, Any]:
    """What the comparison with HSDP reads: each batch's loss, the samples each rank read, the gradient norms of the
    optimizer steps, the full parameters."""
    return {"losses": [r["loss"] for r in log.rows], "read": _read_by_all_ranks(model), "grad_norms": log.grad_norms,
            "params": {k: v.tolist() for k, v in full_state(model).items()}}  # fmt: skip


ACCUMULATE = 2  # micro-batches per optimizer step of the accumulated runs: one epoch is 4 steps


def hsdp_accumulated(devices: int, workdir: str) -> dict[str, Any]:
    """``hsdp`` with ``ACCUMULATE`` micro-batches per optimizer step."""
    return hsdp(devices, workdir, ACCUMULATE)


def accumulated(devices: int, workdir: str) -> dict[str, Any]:
    """This job is one of 2 replica groups, nothing fails: the run of ``hsdp_accumulated`` (the gradients averaged
    across groups and the step committed once per optimizer step, after the last micro-batch)."""
    options = {"fault_tolerance": {"quorum_timeout": 30.0, "timeout": 20.0}, "on_nonfinite": "skip"}
    steps = SAMPLES // GLOBAL_BATCH // ACCUMULATE
    model, trainer, log = _fit(FSDP2Strategy(**options), devices, steps, accumulate_grad_batches=ACCUMULATE)
    summary = trainer.strategy.fault_tolerance_summary
    return {**_trained(model, log), "committed": summary["committed"], "skipped": summary["skipped"],
            "reduced_in_backward": summary["reduced_in_backward"]}  # fmt: skip


def timed_hsdp(devices: int, workdir: str) -> dict[str, Any]:
    """The step times of HSDP on ``devices`` processes (2 replicas), the timed model, no fault tolerance."""
    strategy = FSDP2Strategy(sharding="hybrid", data_parallel_replicate_size=2, data_parallel_shard_size=devices // 2)
    _, _, log = _fit(strategy, devices, TIMED_STEPS, model_options=TIMED_MODEL)
    return {"seconds": [r["seconds"] for r in log.rows]}


def timed_groups(devices: int, workdir: str) -> dict[str, Any]:
    """This job is one of 2 replica groups: the step times of the timed model. ``FT_AFTER_BACKWARD=1`` averages the
    gradients across groups after the backward, in one flat buffer (what every mesh without FSDP2 does), instead of
    in FSDP2's all-reduce hook during it."""
    if os.environ.get("FT_AFTER_BACKWARD") == "1":
        from lightning_dist.parallel.fault_tolerance import ReplicaGroups

        ReplicaGroups.reduce_in_backward = lambda self, model: False  # type: ignore[method-assign]
    strategy = FSDP2Strategy(fault_tolerance={"quorum_timeout": 60.0, "timeout": 60.0})
    _, trainer, log = _fit(strategy, devices, TIMED_STEPS, model_options=TIMED_MODEL)
    summary = trainer.strategy.fault_tolerance_summary
    return {"seconds": [r["seconds"] for r in log.rows], "reduced_in_backward": summary["reduced_in_backward"],
            "committed": summary["committed"]}  # fmt: skip


CHAOS_STEPS = int(os.environ.get("CHAOS_STEPS", "30"))
CHAOS_STEP_SLEEP = float(os.environ.get("CHAOS_STEP_SLEEP", "0.2"))
CHAOS_ALONE_SLEEP = float(os.environ.get("CHAOS_ALONE_SLEEP", "2.0"))


def _chaos_strategy() -> Any:
    options = {"fault_tolerance": {"quorum_timeout": 30.0, "timeout": 20.0}, "on_nonfinite": "skip"}
    mesh = os.environ.get("CHAOS_MESH", "")
    if mesh == "pp2tp2":
        return Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, **options)
    if mesh == "zeropp":
        return ZeroPPStrategy(**options)
    return FSDP2Strategy(**options)


def chaos(devices: int, workdir: str) -> dict[str, Any]:
    launched = float(os.environ.get("FT_LAUNCHED_AT", time.time()))
    group = os.environ["LIGHTNING_DIST_REPLICA_GROUP_ID"]
    snapshot = Path(workdir) / f"chaos_early_g{group}.json"
    model, trainer, log = _fit(
        _chaos_strategy(),
        devices,
        CHAOS_STEPS,
        step_sleep=CHAOS_STEP_SLEEP,
        alone_sleep=CHAOS_ALONE_SLEEP,
        snapshot=None if snapshot.exists() else snapshot,  # a relaunched group keeps its first launch's
        checkpoints=Path(workdir) / "checkpoints",
    )
    groups = trainer.strategy.fault_tolerance_summary
    optimizer = trainer.optimizers[0]
    shards = {
        "params": {n: local_tensor(p).detach().clone() for n, p in model.named_parameters()},
        "optimizer": [
            {k: local_tensor(v).clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
            for group in optimizer.param_groups
            for p in group["params"]
        ],
    }
    group_id = trainer.strategy.fault_tolerance.replica_group_id
    torch.save(shards, Path(workdir) / f"chaos_g{group_id}_r{trainer.global_rank}.pt")
    first_commit = next((r for r in log.rows if r["committed"]), None)
    return {
        "rows": log.rows,
        "launched": launched,
        "first_commit_after_launch": (first_commit["end"] - launched) if first_commit else None,
        "heals": groups["heals"],
        "received_bytes": groups["received_bytes"],
        "committed": groups["committed"],
        "skipped": groups["skipped"],
        "global_step": trainer.global_step,
        "read": _read_by_all_ranks(model),
    }


if __name__ == "__main__":
    run_scenario_script(
        {
            "hsdp": hsdp,
            "chaos": chaos,
            "hsdp_accumulated": hsdp_accumulated,
            "accumulated": accumulated,
            "timed_hsdp": timed_hsdp,
            "timed_groups": timed_groups,
        }  # fmt: skip
    )
