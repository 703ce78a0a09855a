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
import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel import pipeline as pp
from lightning_dist.parallel.fsdp import FSDPConfig, reshard_all
from lightning_dist.parallel.mesh import ParallelDims, require_split_axis
from lightning_dist.parallel.parallelize import ParallelizeConfig, parallelize
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize
from lightning_dist.strategies.pipeline_step import LogCapture, captured_log, join_outputs, slice_batch


class PipelineStrategy(MeshParallelStrategy):
    """Pipeline parallelism (with FSDP2 inside each stage) for an unchanged LightningModule.

    The step methods must call the model exactly once (``self(x)``); that call is pipelined. Manual optimization is
    not supported. ``predict_step`` returns the outputs in batch order on the ranks holding the last stage and
    ``None`` on the others. Values logged as a torchmetrics ``Metric`` are logged on the loss stage only.

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

    def _runner(self, batch_size: int, training: bool) -> pp.PipelineRunner:
        m = self.microbatches_for(batch_size) if training else self._eval_microbatches(batch_size)
        if m not in self._runners:
            self.log_decision(f"{m} micro-batches for a per-replica batch of {batch_size}")
            self._runners[m] = pp.PipelineRunner(
                self.model_parts, self._stage_ids, self._plan.num_stages, self.schedule, m,
                lambda out, target: self._step_fn(out, target), group=self.process_group("pp"),
                device=self.root_device, scale_grads=False,
            )  # fmt: skip
        return self._runners[m]

    def _eval_microbatches(self, batch_size: int) -> int:
        if self.n_microbatches is not None:
            return self.n_microbatches
        return pp.default_n_microbatches("gpipe", batch_size, self.parallel_dims.pp, 1)

    def _pipelined_call(self, step: str, args: tuple, training: bool) -> tuple[pp.PipelineRunner, dict, int]:
        lm = self.lightning_module
        for part in self.model_parts:
            part.train(lm.training)
        with captured_log(lm, None):
            call = pp.capture_call(self._module, lambda: getattr(lm, step)(*args), what=f"{step}")
        inputs = pp.model_inputs_as_kwargs(self._module, *call)
        batch_size = max(t.shape[0] for t in inputs.values() if isinstance(t, Tensor) and t.dim() > 0)
        return self._runner(batch_size, training), inputs, batch_size

    def _run_step_per_microbatch(self, step: str, args: tuple, batch_size: int, capture: LogCapture) -> Any:
        def run(output: Any, target: Tensor) -> Any:
            start, stop = int(target[0]), int(target[-1]) + 1
            microbatch = slice_batch(args[0], start, stop, batch_size)
            with captured_log(self.lightning_module, capture), pp.substituted_forward(self._module, output, step):
                return getattr(self.lightning_module, step)(microbatch, *args[1:])

        return run

    @override
    def run_training_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        trainer = self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        step_args = (batch, batch_idx, *args)
        runner, inputs, batch_size = self._pipelined_call("training_step", step_args, True)
        calls: list[tuple[Tensor, LogCapture]] = []

        def loss_fn(output: Any, target: Tensor) -> Tensor:
            capture = LogCapture()
            result = self._run_step_per_microbatch("training_step", step_args, batch_size, capture)(output, target)
            loss = result["loss"] if isinstance(result, dict) else result
            calls.append((loss.detach(), capture))
            # The mean over micro-batches and accumulated batches. (torch's scale_grads would also divide the
            # gradients accumulated by earlier batches of the window, so it is off.)
            return loss / (runner.n_microbatches * accumulate)

        self._step_fn = loss_fn
        runner.step(inputs, target=torch.arange(batch_size, device=self.root_device), losses=[])
        # torch's first step of a schedule also calls loss_fn once to infer shapes (on placeholder values): the
        # micro-batches are the last n_microbatches calls.
        calls = calls[len(calls) - runner.n_microbatches :] if calls else []
        loss = torch.stack([c[0] for c in calls]).mean() if calls else torch.zeros((), device=self.root_device)
        return self._share_logs(LogCapture.merge([c[1] for c in calls]), loss)

    @override
    def run_backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return closure_loss  # the schedule ran backward inside the training step

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        def closure_then_sync() -> Any:
            result = closure()
            pp.all_reduce_tied_gradients(self._module, self._ties, self._tie_groups)  # before clipping
            return result

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    @override
    def run_eval_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        runner, inputs, batch_size = self._pipelined_call(step, args, False)
        capture, outputs = LogCapture(), []
        self._step_fn = self._run_step_per_microbatch(step, args, batch_size, capture)
        runner.eval(inputs, target=torch.arange(batch_size, device=self.root_device), losses=outputs)
        if step == "predict_step":
            return join_outputs(outputs) if runner.holds_last_stage else None
        self._share_logs(capture, None)
        return None

    def _share_logs(self, capture: LogCapture, loss: Tensor | None) -> Tensor | None:
        """Average the captured logs over micro-batches, send them from the loss stage and log them on every rank;
        return the loss stage's ``loss``."""
        lm, holds = self.lightning_module, self.mesh["pp"].get_local_rank() == self.loss_stage
        payload = [None]
        if holds:
            logs = [(v.name, v.mean().cpu(), v.args, v.kwargs) for v in capture.logged.values() if not v.is_metric]
            payload = [(None if loss is None else loss.detach().cpu(), logs)]
        dist.broadcast_object_list(payload, group=self.process_group("pp"), group_src=self.loss_stage)
        shared_loss, logs = payload[0]
        for name, value, args, kwargs in logs:
            lm.log(name, value.to(self.root_device), *args, **kwargs)
        for value in capture.logged.values():
            if value.is_metric:
                lm.log(value.name, value.values[-1], *value.args, **value.kwargs)
        return None if shared_loss is None else shared_loss.to(self.root_device)

    def _reshard_after_evaluation(self) -> None:
        for part in self.model_parts:
            reshard_all(part)
