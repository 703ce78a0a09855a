"""How a lightning_dist strategy saves and loads Lightning checkpoints (a mixin of the shared base).

Lightning hands the strategy a checkpoint dict; this mixin puts the model's and optimizers' (sharded) state in it,
adds where it came from (strategy, mesh, data position) and passes it to the checkpoint IO plugin. Loading accepts
a sharded folder or a single file saved with any number of ranks and any lightning_dist strategy (or a one-device
Lightning run). The model and optimizer state functions live in :mod:`lightning_dist.checkpoint.model_state`.

On a pipeline mesh each rank holds only its stages' parameters (under their original names): a full-state save
gathers every stage's state onto rank 0, and a strict load checks the checkpoint's keys against the keys of all
stages together. ``ModuleList`` experts split over ep (litgpt) are handled alike: each rank holds its own experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dist.checkpoint import model_state as states
from lightning_dist.checkpoint.export.model_configs import (
    PRETRAINED_CONFIGS_KEY,
    WEIGHTS_ORIGIN_KEY,
    pretrained_configs,
    weights_origin,
)
from lightning_dist.checkpoint.layout import PROVENANCE_KEY
from lightning_dist.checkpoint.safe_load import resolve_weights_only
from lightning_dist.checkpoint.state_paths import StatePath
from lightning_dist.compat.lightning import StrOrPath
from lightning_dist.parallel.expert_parallel import holds_some_experts
from lightning_dist.plugins.checkpoint_io import DistributedCheckpointIO, ParallelCheckpointIO
from lightning_dist.strategies.lifecycle.data_position import resume_position, training_position
from lightning_dist.version import __version__


class ShardedCheckpointing:
    """Checkpoint saving and loading of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    _checkpoint_io: CheckpointIO | None

    @property
    @override
    def checkpoint_io(self) -> ParallelCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = DistributedCheckpointIO()
        return self._checkpoint_io  # type: ignore[return-value]

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if io is not None and not isinstance(io, ParallelCheckpointIO):
            raise TypeError(
                f"{type(self).__name__} cannot save through {type(io).__name__}: each rank holds only its shards of"
                " the model. Use lightning_dist.DistributedCheckpointIO (the default, sharded),"
                " lightning_dist.AsyncDistributedCheckpointIO (sharded, saved in the background) or"
                " lightning_dist.FullStateCheckpointIO (one consolidated file)."
            )
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    def stage_layout(self) -> states.StageLayout | None:
        """Where the pipeline stages' state lives (``None`` when every rank holds every parameter): full-state saves
        gather from every stage, strict loads check keys over all of them. ``ModuleList`` experts split over ep
        (each rank holds its own experts) make every rank a "stage" of its own, over the whole world."""
        dims = self.parallel_dims
        if not dist.is_initialized():
            return None
        if dims.ep > 1 and holds_some_experts(self.model):
            return states.StageLayout(group=dist.group.WORLD, leader=self.global_rank)
        if dims.pp == 1:
            return None
        per_stage = dims.world_size // dims.pp
        return states.StageLayout(
            group=self.process_group("pp"),
            leader=self.global_rank - self.global_rank % per_stage,
        )

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        model = self.model
        return states.model_state(model, full=self.checkpoint_io.full_state, stages=self.stage_layout)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        model = self.model
        return states.optimizer_state(model, optimizer, full=self.checkpoint_io.full_state, stages=self.stage_layout)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: StrOrPath, storage_options: Any | None = None
    ) -> None:
        path = Path(self.broadcast(str(filepath)))
        full, stages = self.checkpoint_io.full_state, self.stage_layout
        self.averaged_states_into(checkpoint, lambda module: states.model_state(module, full=full, stages=stages))
        checkpoint[PROVENANCE_KEY] = self.checkpoint_provenance()
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            batch_replicas = self.distributed_sampler_kwargs["num_replicas"]  # across replica groups too
            checkpoint[PROVENANCE_KEY]["data_position"] = training_position(trainer, checkpoint, batch_replicas)
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def checkpoint_provenance(self) -> dict[str, Any]:
        """What a checkpoint records of the run that saved it (``meta.pt``'s provenance entry): strategy, world size,
        mesh, format, version, where the weights came from and the pretrained models' configs."""
        provenance = {
            "strategy": type(self).__name__,
            "world_size": self.world_size,
            "mesh": self.parallel_dims.as_dict(),
            "format": "full" if self.checkpoint_io.full_state else "sharded",
            "version": __version__,
        }
        origin = weights_origin(self.initial_weights) or getattr(self, "_weights_origin", None)
        if origin is not None:  # where an export finds the tokenizer of the model trained
            provenance[WEIGHTS_ORIGIN_KEY] = origin
        configs = pretrained_configs(self.lightning_module) if self.lightning_module is not None else []
        if self.parallel_dims.pp > 1:  # each stage holds its own LoRA layers: the record lists every stage's
            configs = self._with_every_stage_lora_layers(configs)
        if configs:  # what `lightning-dist export` writes config.json / model_config.yaml from
            provenance[PRETRAINED_CONFIGS_KEY] = configs
        return provenance

    def _with_every_stage_lora_layers(self, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, [r.get("layers") for r in configs if r.get("format") == "peft"])
        joined = [r for r in configs if r.get("format") == "peft"]
        for layers in gathered:
            for record, more in zip(joined, layers):
                record["layers"] = {**more, **record["layers"]}
        return configs

    @override
    def load_checkpoint(self, checkpoint_path: StrOrPath, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded folder or a single-file checkpoint, whichever ``checkpoint_path`` is, saved with any number
        of ranks and any lightning_dist strategy (or a one-device Lightning run). ``weights_only`` means what it
        means to Lightning: ``None`` (the default) and ``True`` unpickle nothing but tensors and plain data, ``False``
        trusts the file."""
        path = Path(self.broadcast(str(checkpoint_path)))
        self.checkpoint_io.wait()
        module = self.lightning_module
        assert self.model is not None and module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizers = [o.optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        optimizers = optimizers if fitting else []
        targets: dict[StatePath, Module] = {}

        def choose(saved: list[StatePath]) -> dict[StatePath, Module]:
            targets.update(self.model_state_targets(saved))  # weight averaging's copies load their own states
            return targets

        metadata = states.load_checkpoint_into(
            path,
            self.model,
            optimizers,
            module.strict_loading,
            self.stage_layout,
            weights_only=resolve_weights_only(self._requested_weights_only if weights_only is None else weights_only),
            targets=choose,
        )
        metadata = self.with_live_states(metadata, targets)
        self.hand_over_swa_schedulers(metadata)
        provenance = metadata.get(PROVENANCE_KEY, {})
        recorded = provenance.get("data_position") if isinstance(provenance, dict) else None
        if isinstance(provenance, dict) and isinstance(provenance.get(WEIGHTS_ORIGIN_KEY), str):
            self._weights_origin = provenance[WEIGHTS_ORIGIN_KEY]  # a resumed run came from the same weights
        self._resume_position = resume_position(metadata, recorded) if fitting else None
        self._resume_loader_index = 0
        return metadata

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint()
