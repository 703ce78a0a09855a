"""``fault_tolerance``, the option of fsdp2 (and zeropp) and hybrid3d: joining and healing at setup, the samplers
across groups, checkpoints by the first live group, the progress record and the metrics."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from typing_extensions import override

from lightning_dist.parallel.fault_tolerance import (
    FaultToleranceOptions,
    ReplicaGroups,
    ReplicaState,
    resolve_fault_tolerance,
)
from lightning_dist.strategies.lifecycle.data_position import resume_position, training_position
from lightning_dist.strategies.parallelisms.fault_tolerance.part import FaultTolerancePart

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.compat.lightning import StrOrPath
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object

#: What ``fault_tolerance`` accepts: the options, a dict of them (YAML), ``True`` (all from the environment) or off.
FaultToleranceSpec = FaultToleranceOptions | dict[str, Any] | bool | None


class FaultToleranceOption(_Base):
    """``fault_tolerance``: this job is one replica group of several, kept in step by torchft."""

    declared_parts = (FaultTolerancePart,)
    #: The resolved option (``None``: off).
    fault_tolerance: FaultToleranceOptions | None = None
    _replica_groups: ReplicaGroups | None = None
    _healing_at_setup = False
    _summary: Mapping[str, Any] = MappingProxyType({})
    _requested_ckpt_path: Any = None

    def init_fault_tolerance(self, value: FaultToleranceSpec) -> None:
        """Check and keep the option (fields left out come from the environment)."""
        self.fault_tolerance = resolve_fault_tolerance(value)

    @override
    def preflight(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        self._requested_ckpt_path = arguments.get("ckpt_path")  # Lightning resolves it only after setup
        super().preflight(trainer, arguments)

    @property
    def replica_groups(self) -> ReplicaGroups | None:
        """torchft's view of the replica groups while fitting; ``None`` otherwise."""
        return self._replica_groups

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every group's data-parallel ranks together: group ``g``'s rank ``r`` of ``n`` is replica ``g·n + r``."""
        kwargs = super().distributed_sampler_kwargs
        options = self.fault_tolerance
        if options is None:
            return kwargs
        replicas = kwargs["num_replicas"]
        assert options.num_replica_groups is not None and options.replica_group_id is not None
        return {"num_replicas": replicas * options.num_replica_groups,
                "rank": options.replica_group_id * replicas + kwargs["rank"]}  # fmt: skip

    # ------------------------------------------------------------------ joining, healing
    def join_replica_groups(self, trainer: pl.Trainer) -> None:
        """Build this group's torchft manager and form the first step's quorum. A group behind the live ones (started
        late, or relaunched after a failure) copies their state here, before its dataloaders are read, and starts at
        their step and data position; ``ckpt_path`` is then not read."""
        options = self.fault_tolerance
        assert options is not None and self.model is not None
        state = ReplicaState(
            self.model, self._plain_optimizers, extra_state=self._trainer_state, load_extra=self._load_trainer_state
        )
        self._replica_groups = groups = ReplicaGroups(
            options, state, self.global_rank, self.world_size, self.process_group_backend or "gloo"
        )
        self._healing_at_setup = True
        try:
            groups.join()
        finally:
            self._healing_at_setup = False
        self._refuse_a_restart_from_scratch(trainer)
        groups.check_same_start()
        if groups.reduce_in_backward(self.model):
            self.log_decision(
                "gradients averaged across replica groups during backward: each FSDP2 unit's reduced shards through"
                " torchft's process group (FSDP2's all-reduce hook, where HSDP all-reduces)"
            )
        joined = f"replica group {options.replica_group_id} of {options.num_replica_groups}"
        if state.heals:
            self.log_decision(
                f"{joined} healed from a live group at step {groups.step} (global step {trainer.global_step}):"
                f" received {state.received_bytes:,} bytes per rank; quorum of {groups.quorum_size} groups"
            )
        else:
            self.log_decision(
                f"{joined} joined a quorum of {groups.quorum_size} at step {groups.step} (lighthouse"
                f" {options.lighthouse})"
            )

    # ------------------------------------------------------------------ a group's record of its progress
    def _progress_record(self, trainer: pl.Trainer) -> Path | None:
        """Where this group records the step it reached (``<default_root_dir>/fault_tolerance/replica_group_<id>
        .json``, removed when ``fit`` ends normally); ``None`` for a remote root directory."""
        root = str(trainer.default_root_dir)
        if "://" in root or self.fault_tolerance is None:
            return None
        return Path(root) / "fault_tolerance" / f"replica_group_{self.fault_tolerance.replica_group_id}.json"

    def record_progress(self) -> None:
        """After each committed step: the group's step, so that a relaunch with no live group to heal from is
        recognized instead of silently starting over."""
        trainer = self.lightning_module.trainer
        path = self._progress_record(trainer)
        if path is None or self.global_rank != 0 or self._replica_groups is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".json.partial")
        # the commit comes before the optimizer's step, which Lightning counts after it returns
        step = {"step": self._replica_groups.step, "global_step": trainer.global_step + 1}
        partial.write_text(json.dumps(step))
        os.replace(partial, path)

    def _refuse_a_restart_from_scratch(self, trainer: pl.Trainer) -> None:
        """A group whose record says it trained before, and that found no live group to heal from, would start over
        at step 0: refused unless ``ckpt_path`` says where to resume."""
        groups = self._replica_groups
        assert groups is not None
        if groups.state.heals or groups.step > 0 or self._requested_ckpt_path is not None:
            return
        path = self._progress_record(trainer)
        record = json.loads(path.read_text()) if path is not None and path.is_file() and self.global_rank == 0 else None
        record = self.broadcast(record)
        if not record or int(record.get("step", 0)) <= 0:
            return
        raise RuntimeError(
            f"fault_tolerance: replica group {self.fault_tolerance.replica_group_id} trained to step {record['step']}"
            f" (global step {record.get('global_step')}) before it stopped ({path}), and no live replica group is"
            " left to copy the state from: it would silently start over at step 0. Resume every group from a"
            " checkpoint (fit(..., ckpt_path='last') with a ModelCheckpoint), or delete that file to start afresh."
        )

    @override
    def on_train_end(self) -> None:
        super().on_train_end()
        path = self._progress_record(self.lightning_module.trainer)
        if path is not None and self.global_rank == 0:
            path.unlink(missing_ok=True)  # a normal end: a later start of this group is a new run

    def _plain_optimizers(self) -> list[Any]:
        return [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]

    def _trainer_state(self) -> dict[str, Any]:
        """What a healing group needs of Lightning besides the tensors: loop counters (global step, epoch, batch),
        the data position they imply, and the schedulers."""
        trainer = self.lightning_module.trainer
        fit_loop = copy.deepcopy(trainer.fit_loop.state_dict())
        # Asked for before a batch is trained on (the step's quorum), when Lightning has already fetched it: its
        # "last batch" flag is about that batch, which the healing group is to train on, not about the ones done.
        batches = fit_loop.get("epoch_loop.batch_progress")
        if isinstance(batches, dict):
            batches["is_last_batch"] = False
        checkpoint = {"loops": {"fit_loop": fit_loop}}
        position = training_position(trainer, checkpoint, self.distributed_sampler_kwargs["num_replicas"])
        schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
        return {"loops": checkpoint["loops"], "data_position": position, "schedulers": schedulers}

    def _load_trainer_state(self, extra: Mapping[str, Any]) -> None:
        trainer = self.lightning_module.trainer
        for config, saved in zip(trainer.lr_scheduler_configs, extra["schedulers"]):
            config.scheduler.load_state_dict(saved)
        if self._healing_at_setup:  # later heals happen mid-step: the loops already stand where the live groups do
            trainer.fit_loop.load_state_dict(extra["loops"]["fit_loop"])
            self._resume_position = resume_position(extra["loops"], extra["data_position"])
            self._resume_loader_index = 0

    def log_fault_tolerance(self) -> None:
        """The step's metrics: groups in the quorum, steps skipped and heals so far (the same on every rank of the
        group)."""
        groups = self._replica_groups
        if groups is None:
            return
        self.lightning_module.log_dict(
            {
                "fault_tolerance/quorum_size": float(groups.quorum_size),
                "fault_tolerance/skipped_steps": float(groups.skipped_steps),
                "fault_tolerance/heals": float(groups.state.heals),
            },
            on_step=True,
            on_epoch=False,
        )

    # ------------------------------------------------------------------ checkpoints
    def writes_checkpoints(self) -> bool:
        """Whether this group writes checkpoints: the first live group while fitting, group 0 otherwise."""
        if self.fault_tolerance is None:
            return True
        if self._replica_groups is not None:
            return self._replica_groups.first_live_group
        return self.fault_tolerance.replica_group_id == 0

    @override
    def load_checkpoint(self, checkpoint_path: StrOrPath, weights_only: bool | None = None) -> dict[str, Any]:
        groups = self._replica_groups
        if groups is not None and groups.state.heals:
            self.log_decision(f"ckpt_path={str(checkpoint_path)!r} not read: healed from a live replica group")
            return {}
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: StrOrPath, storage_options: Any | None = None
    ) -> None:
        if self.writes_checkpoints():
            super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def checkpoint_provenance(self) -> dict[str, Any]:
        provenance = super().checkpoint_provenance()
        options, groups = self.fault_tolerance, self._replica_groups
        if options is not None:  # which group wrote it, and torchft's step then
            provenance["fault_tolerance"] = {
                "replica_group_id": options.replica_group_id,
                "num_replica_groups": options.num_replica_groups,
                "step": groups.step if groups is not None else None,
            }
        return provenance

    @override
    def remove_checkpoint(self, filepath: StrOrPath) -> None:
        if self.writes_checkpoints():
            super().remove_checkpoint(filepath)

    @property
    def fault_tolerance_summary(self) -> dict[str, Any]:
        """What happened to this group in the last ``fit``: committed and skipped steps, heals and the bytes the
        last one received, the last quorum's size, torchft's step, and whether gradients were averaged across
        groups during the backward (FSDP2) rather than after it."""
        groups = self._replica_groups
        if groups is None:
            return dict(self._summary)
        return {
            "committed": groups.committed_steps,
            "skipped": groups.skipped_steps,
            "heals": groups.state.heals,
            "received_bytes": groups.state.received_bytes,
            "quorum_size": groups.quorum_size,
            "step": groups.step,
            "reduced_in_backward": groups.reduces_in_backward,
        }

    @override
    def teardown(self) -> None:
        if self._replica_groups is not None:
            self._summary = self.fault_tolerance_summary
        groups, self._replica_groups = self._replica_groups, None
        try:
            super().teardown()
        finally:
            if groups is not None:
                groups.shutdown()
