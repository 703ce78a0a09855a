"""PipelineStrategy: pipeline parallelism for an unchanged LightningModule, on torch's schedules.

The model is cut into stages in place (:mod:`lightning_dist.parallel.pipeline`): each rank keeps only its stages'
modules, under their original names. A training step runs the user's ``training_step`` up to its one model call to
get the call's arguments, pipelines that call, and on the last stage runs ``training_step`` again per micro-batch
with the model call returning the pipeline's output; its loss drives the schedule's backward. Values the step logs
are combined over micro-batches by their ``reduce_fx`` (sums summed, means averaged), sent from the loss stage to every stage and logged there with their original
arguments, so every rank logs and returns the same numbers.
"""

from __future__ import annotations

from typing import Any

from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel.mesh import ParallelDims, require_split_axis
from lightning_dist.parallel.parallelize import parallelize
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize
from lightning_dist.strategies.parallelisms.pipeline.step import PipelineSteps


class PipelineStrategy(PipelineSteps, MeshParallelStrategy):
    """Pipeline parallelism (with FSDP2 inside each stage) for an unchanged LightningModule.

    The step methods must call the model exactly once (``self(x)``, or ``self.model(input_ids=x, labels=y)`` for a
    Hugging Face model in ``self.model``: the innermost module holding every parameter is pipelined). Manual
    optimization is refused before launch. A stage with nothing to optimize (frozen) runs in the schedule and its
    optimizer, given one empty param group, steps nothing. ``predict_step`` returns the outputs in batch order on
    the ranks holding the last stage and ``None`` on the others. A torchmetrics ``Metric`` logged on the loss stage is logged on every rank with the loss
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
        **kwargs: The options every strategy takes (``reshard_after_forward``, off by default here, ``wrap_modules``,
            ``activation_checkpointing``, ``compile``...): see
            :class:`~lightning_dist.strategies.base.MeshParallelStrategy`.
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
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.init_pipeline(schedule, n_microbatches, stages_per_rank, split)
        self.pipeline_parallel_size = pipeline_parallel_size
        self.data_parallel_shard_size = data_parallel_shard_size

    @override
    def mesh_sizes(self) -> dict[str, MeshSize]:
        return {"pp": self.pipeline_parallel_size, "dp_shard": self.data_parallel_shard_size}

    @override
    def validate_mesh(self, dims: ParallelDims) -> None:
        require_split_axis(dims, "pp", "pipeline_parallel_size", "pipeline parallelism")

    @override
    def check_model(self, model: Module) -> None:
        if self.pipelined:
            self.check_pipeline_model(model)

    @override
    def parallelize(self, model: Module) -> Module:
        stages, last = self.cut_stages(model), self.stage_plan.num_stages - 1
        for (part, blocks), stage in zip(stages, self.stage_ids):
            config, root = self.standard_parallelize_config(blocks, feeds_loss=stage == last), type(part).__name__
            record = parallelize(part, self.mesh, config)
        self.model_parts = [part for part, _ in stages]
        self.log_layout(config, record, root, per_stage=True)
        return model
