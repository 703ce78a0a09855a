"""Running this rank's stage modules through a torch schedule, one whole batch per call.

Every rank of a pipeline group calls :meth:`PipelineRunner.step` (or :meth:`~PipelineRunner.eval`) with the same
model inputs: all stages replay the forward from them (see :mod:`.stage`), so only the boundary activation travels
between ranks. torch's stages size their receive buffers from the first batch; a batch of another shape (the last,
smaller batch) gets its own stages and schedule, kept in a small cache. Evaluation uses its own forward-only pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage

from lightning_dist.parallel.pipeline.forward_only import forward_only
from lightning_dist.parallel.pipeline.outputs import rebuild_output
from lightning_dist.parallel.pipeline.schedule import (
    FORWARD_ONLY_RULE,
    build_schedule,
    schedule_info,
    validate_microbatching,
)
from lightning_dist.parallel.pipeline.shape_inference import isolate_shape_inference
from lightning_dist.parallel.pipeline.split import stage_owner
from lightning_dist.parallel.pipeline.stage import stage_runtime

LossFn = Callable[[Any, Any], torch.Tensor]

_REENTRANT_CHECKPOINT = "When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()"
REENTRANT_CHECKPOINT_MESSAGE = (
    "The model uses torch.utils.checkpoint with use_reentrant=True (transformers:"
    " gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': True}), or a checkpoint call in"
    " its own forward), which cannot run in a pipeline stage: torch's schedule computes each stage's input gradients"
    " with torch.autograd.grad, and reentrant checkpointing refuses that. Use use_reentrant=False (transformers:"
    " gradient_checkpointing_kwargs={'use_reentrant': False}), or leave checkpointing to the strategy:"
    " activation_checkpointing=True."
)


class PipelineRunner:
    """This rank's part of a pipeline: its stage modules, the schedule, and the loss on the last stage.

    Args:
        parts: The stage modules from :func:`~.stage.cut_pipeline_stages` (after any FSDP2/TP is applied to them).
        stage_ids: The stage index of each part.
        num_stages: Stages in the whole pipeline.
        schedule: Schedule name (see :mod:`.schedule`).
        n_microbatches: Micro-batches per step.
        loss_fn: ``loss_fn(model_output, target_microbatch) -> loss`` on the last stage, where ``model_output`` is
            what the user's forward returned for the micro-batch (rebuilt from the stage's tensors).
        group: The pipeline process group (``None``: the world).
        device: The device of activations.
        scale_grads: Divide gradients by the number of micro-batches (a mean over micro-batches).
    """

    def __init__(
        self,
        parts: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        schedule: str,
        n_microbatches: int,
        loss_fn: LossFn | None,
        group: Any = None,
        device: torch.device | str = "cpu",
        scale_grads: bool = True,
        max_cached_shapes: int = 4,
    ) -> None:
        if len(parts) != len(stage_ids):
            raise ValueError(f"{len(parts)} stage modules for {len(stage_ids)} stage ids.")
        self.parts = list(parts)
        self.stage_ids = list(stage_ids)
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.group = group
        self.device = torch.device(device)
        self.scale_grads = scale_grads
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._max_cached = max_cached_shapes
        self.stages: list[PipelineStage] = []  # torch's stages of the latest batch shape (for instrumentation)

    @property
    def holds_last_stage(self) -> bool:
        """Whether the loss (and the model output) is computed on this rank."""
        return self.num_stages - 1 in self.stage_ids

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_ids

    def step(self, model_inputs: dict[str, Any], target: Any = None, losses: list | None = None) -> None:
        """Forward and backward of one batch; gradients accumulate into the stage parameters.

        Args:
            model_inputs: The model call as keyword arguments (:func:`~.stage.model_inputs_as_kwargs`); tensors
                are split into micro-batches along dim 0 (a tensor with dim 0 of size 1 is broadcast).
            target: A tensor split along dim 0 and passed, per micro-batch, to ``loss_fn``.
            losses: Receives the per-micro-batch losses on the last stage.
        """
        schedule = self._schedule_for(model_inputs)
        try:
            schedule.step(target=target, losses=losses, return_outputs=False, **self._batched(model_inputs))
        except RuntimeError as err:
            if _REENTRANT_CHECKPOINT in str(err):
                raise RuntimeError(REENTRANT_CHECKPOINT_MESSAGE) from err
            raise

    def eval(self, model_inputs: dict[str, Any], target: Any = None, losses: list | None = None) -> None:
        """Forward only (:mod:`.forward_only`, any batch shape); ``loss_fn`` runs per micro-batch on the last stage
        and its results go to ``losses``, in micro-batch order."""
        batched = self._batched(model_inputs)
        m = self.n_microbatches
        validate_microbatching(FORWARD_ONLY_RULE, _batch_size(batched), m, self.pp_size, 1)
        chunks = {k: torch.tensor_split(v, m) if _is_batched(v) else [v] * m for k, v in batched.items()}
        microbatches = [{k: chunks[k][i] for k in batched} for i in range(m)]
        targets = torch.tensor_split(target, m) if isinstance(target, torch.Tensor) else [target] * m

        def on_output(output: Any, index: int) -> None:
            if self.loss_fn is not None:
                loss = self._stage_loss(output, targets[index])
                if losses is not None:
                    losses.append(loss)

        placement = schedule_info(self.schedule_name).placement
        with torch.no_grad():
            forward_only(
                self.parts,
                self.stage_ids,
                self.num_stages,
                lambda stage: stage_owner(stage, self.pp_size, placement),
                microbatches,
                on_output,
                group=self.group,
                device=self.device,
            )

    @property
    def pp_size(self) -> int:
        return self.num_stages // len(self.stage_ids)

    def _batched(self, model_inputs: dict[str, Any]) -> dict[str, Any]:
        batch = _batch_size(model_inputs)
        out = {}
        for key, value in model_inputs.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] != batch:
                if value.shape[0] != 1:
                    raise ValueError(
                        f"Model input {key!r} has {value.shape[0]} rows but the batch has {batch}; pipeline"
                        " micro-batching splits every tensor input along dim 0 (size 1 is broadcast)."
                    )
                value = value.expand(batch, *value.shape[1:])
            out[key] = value
        return out

    def _schedule_for(self, model_inputs: dict[str, Any]) -> Any:
        batch = _batch_size(model_inputs)
        validate_microbatching(self.schedule_name, batch, self.n_microbatches, self.pp_size, len(self.stage_ids))
        key = tuple(
            (k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, type(v).__name__)
            for k, v in model_inputs.items()
        )
        if key in self._cache:
            self._cache.move_to_end(key)
            self.stages, schedule = self._cache[key]
            return schedule
        stages = [
            PipelineStage(part, index, self.num_stages, self.device, group=self.group)
            for part, index in zip(self.parts, self.stage_ids)
        ]
        for stage, part in zip(stages, self.parts):
            isolate_shape_inference(stage, part)
        schedule = build_schedule(
            self.schedule_name,
            stages,
            self.n_microbatches,
            self._stage_loss if self.loss_fn else None,
            self.scale_grads,
        )
        self._cache[key] = (stages, schedule)
        self.stages = stages
        while len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return schedule

    def _stage_loss(self, output: Any, target: Any) -> torch.Tensor:
        last = self.parts[self.stage_ids.index(self.num_stages - 1)]
        recipe = stage_runtime(last).output_recipe
        assert self.loss_fn is not None and recipe is not None
        return self.loss_fn(rebuild_output(output, recipe), target)


def _is_batched(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _batch_size(model_inputs: dict[str, Any]) -> int:
    sizes = [v.shape[0] for v in model_inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not sizes:
        raise ValueError("The model call has no batched tensor input to split into micro-batches.")
    return max(sizes)
