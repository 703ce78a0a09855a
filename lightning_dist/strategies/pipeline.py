"""PipelineStrategy: pipeline parallelism for an unchanged LightningModule, on torch's schedules.

The model is cut into stages in place (:mod:`lightning_dist.parallel.pipeline`): each rank keeps only its stages'
modules, under their original names. A training step runs the user's ``training_step`` up to its one model call to
get the call's arguments, pipelines that call, and on the last stage runs ``training_step`` again per micro-batch
with the model call returning the pipeline's output; its loss drives the schedule's backward. Values the step logs
are averaged over micro-batches, sent from the loss stage to every stage and logged there with their original
arguments, so every rank logs and returns the same numbers.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel import pipeline as pp
from lightning_dist.parallel.fsdp import FSDPConfig, reshard_all
from lightning_dist.parallel.mesh import ParallelDims, require_split_axis
from lightning_dist.parallel.parallelize import ParallelizeConfig, parallelize
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize
from lightning_dist.strategies.pipeline_step import PipelineSteps


class PipelineStrategy(PipelineSteps, MeshParallelStrategy):
    """Pipeline parallelism (with FSDP2 inside each stage) for an unchanged LightningModule.

    The step methods must call the model exactly once (``self(x)``, or ``self.model(input_ids=x, labels=y)`` for a
    Hugging Face model in ``self.model``: the innermost module holding every parameter is pipelined). Manual
    optimization is not supported. ``predict_step`` returns the outputs in batch order on the ranks holding the last
    stage and ``None`` on the others. A torchmetrics ``Metric`` logged on the loss stage is logged on every rank with the loss
    stage's state (epoch values are exact; a step value is that of the last micro-batch).

    Args:
        pipeline_parallel_size: Ranks in one pipeline (``"auto"``: all processes not used by data parallelism).
        data_parallel_shard_size: FSDP2 shard group size inside each stage (pp × dp mesh).
        schedule: A schedule name of :data:`lightning_dist.parallel.pipeline.SCHEDULES` (gpipe, 1f1b,
            interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble, dualpipev).
        n_microbatches: Micro-batches per step; default: chosen from the per-replica batch size (and logged).
        stages_per_rank: Stages each rank holds (multi-stage schedules; default 2 for them, 1 otherwise).
        split: ``"auto"`` (balance the repeated blocks), the module names where stages 1, 2, ... begin, or one
            list of module names per stage.
        activation_checkpointing: Recompute the local blocks' activations in backward.
        **kwargs: Options of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`.
    """

    log_name = "pipeline"

    def __init__(
        self,
        pipeline_parallel_size: MeshSize = "auto",
        data_parallel_shard_size: int = 1,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        stages_per_rank: int | None = None,
        split: str | list[str] | list[list[str]] = "auto",
        activation_checkpointing: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.schedule = schedule.lower()
        self.info = pp.schedule_info(self.schedule)  # refuses an unknown name
        self.stages_per_rank = pp.resolve_stages_per_rank(self.schedule, stages_per_rank)
        if n_microbatches is not None and (isinstance(n_microbatches, bool) or int(n_microbatches) < 1):
            raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}.")
        self.pipeline_parallel_size = pipeline_parallel_size
        self.data_parallel_shard_size = data_parallel_shard_size
        self.n_microbatches = n_microbatches
        self.split = split
        self.activation_checkpointing = activation_checkpointing
        self._runners: dict[int, pp.PipelineRunner] = {}
        self._ties: list[pp.TiedParameter] = []
        self._tie_groups: list[Any] = []
        self._step_fn: Any = None  # what the runners' loss_fn runs on the last stage, per micro-batch

    @override
    def mesh_sizes(self) -> dict[str, MeshSize]:
        return {"pp": self.pipeline_parallel_size, "dp_shard": self.data_parallel_shard_size}

    @override
    def validate_mesh(self, dims: ParallelDims) -> None:
        require_split_axis(dims, "pp", "pipeline_parallel_size", "pipeline parallelism")

    @property
    @override
    def loss_stage(self) -> int:
        return 0 if self.info.placement == "v" else self.parallel_dims.pp - 1  # V: rank 0 holds the last stage

    def microbatches_for(self, batch_size: int) -> int:
        """The number of micro-batches for a per-replica batch of ``batch_size`` (refuses an invalid setting)."""
        p, v = self.parallel_dims.pp, self.stages_per_rank
        if self.n_microbatches is None:
            return pp.default_n_microbatches(self.schedule, batch_size, p, v)
        pp.validate_microbatching(self.schedule, batch_size, self.n_microbatches, p, v)
        return self.n_microbatches

    @override
    def parallelize(self, model: Module) -> Module:
        dims, v = self.parallel_dims, self.stages_per_rank
        where = pp.find_pipelined_module(model)
        self._module = model.get_submodule(where)  # the module whose one call the steps make, pipelined
        plan = pp.plan_stages(self._module, dims.pp * v, self.split)
        self._plan = plan
        self._ties = pp.find_tied_parameters(self._module, plan)
        ranks = self.mesh.world.mesh.movedim(0, -1).reshape(-1, dims.pp).tolist()  # every pipeline group
        self._tie_groups = pp.new_tie_groups(self._ties, ranks, v, self.info.placement)
        self._stage_ids = pp.stage_ids_for_rank(self.mesh["pp"].get_local_rank(), dims.pp, v, self.info.placement)
        parts = pp.cut_pipeline_stages(self._module, plan, self._stage_ids, self.root_device)
        for part, stage in zip(parts, self._stage_ids):
            local = set(plan.stages[stage]) & set(plan.blocks)  # not the stand-ins of other stages' blocks
            blocks = [(n, m) for n, m in part.named_modules() if n in local]
            fsdp = FSDPConfig(mp_policy=self.precision_plugin.mp_policy) if dims.dp_shard > 1 else None
            config = ParallelizeConfig(units=blocks, activation_checkpointing=self.activation_checkpointing, fsdp=fsdp)
            config.root_mp_policy = self.precision_plugin.root_mp_policy if fsdp else None
            parallelize(part, self.mesh, config)
        self.model_parts = parts
        if where:
            self.log_decision(f"pipelining {where} ({type(self._module).__name__}), the module holding every parameter")
        if self.activation_checkpointing:
            self.log_decision("activation checkpointing on every local block")
        if dims.dp_shard > 1:
            self.log_decision(f"FSDP2 inside each stage over dp_shard={dims.dp_shard} (blocks, then the stage root)")
        self.log_decision(
            f"schedule {self.schedule}, {v} stage(s) per rank over pp={dims.pp}, placement {self.info.placement}"
        )
        for line in plan.describe():
            self.log_decision(line)
        for tie in self._ties:
            self.log_decision(f"tied across stages, gradients summed: {tie.describe()}")
        return model

    @override
    def _make_replicas_equal(self) -> None:
        super()._make_replicas_equal()
        pp.broadcast_tied_parameters(self._module, self._ties, self._tie_groups)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if not trainer.lightning_module.automatic_optimization:
            raise RuntimeError(
                "The pipeline strategy runs forward and backward inside its schedule and does not support manual"
                " optimization (automatic_optimization=False). Use automatic optimization or another strategy."
            )
        super().setup(trainer)
        # The schedule runs backward: Lightning's closure must neither zero the gradients nor call backward.
        trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward = True

    def _reshard_after_evaluation(self) -> None:
        for part in self.model_parts:
            reshard_all(part)
