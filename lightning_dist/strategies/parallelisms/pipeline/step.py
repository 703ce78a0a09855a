"""The pipeline strategy's steps: a training step runs the user's ``training_step`` up to its one model call to get
the call's arguments, pipelines that call, and on the last stage runs ``training_step`` again per micro-batch with
the model call returning the pipeline's output; its loss drives the schedule's backward. Evaluation steps do the
same through the forward-only pass. Also the helpers that slice a batch into micro-batches and put predictions back
in batch order."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_dist.parallel import pipeline as pp
from lightning_dist.strategies.parallelisms.pipeline.logs import LogCapture, MetricSteps, captured_log, share_logs
from lightning_dist.strategies.parallelisms.pipeline.part import PipelinePart
from lightning_dist.strategies.parallelisms.pipeline.stages import PipelineStages


class PipelineSteps(PipelineStages):
    """The step methods of a pipeline strategy (a mixin before the base); Lightning's own when ``pp == 1``."""

    declared_parts = (PipelinePart,)

    _warned_labels = False
    _warned_batch_norm = False
    #: The mesh groups a logged value may name as its ``sync_dist_group``, by name (see ``logs.share_logs``).
    _log_groups: dict[str, Any] | None = None

    def _runner(self, batch_size: int, training: bool) -> pp.PipelineRunner:
        m = self.microbatches_for(batch_size, training)
        if m not in self._runners:
            self.log_decision(f"{m} micro-batches for a per-replica batch of {batch_size}")
            if training and m > 1 and not self._warned_batch_norm:
                self._warned_batch_norm = True
                accumulate = self.lightning_module.trainer.accumulate_grad_batches
                warn_batch_norm_per_microbatch(self.lightning_module, m, batch_size, accumulate)
            self._runners[m] = pp.PipelineRunner(
                self.model_parts, self._stage_ids, self._plan.num_stages, self.schedule, m,
                lambda out, target: self._step_fn(out, target), group=self.process_group("pp"),
                device=self.root_device, scale_grads=False,
            )  # fmt: skip
        return self._runners[m]

    def _pipelined_call(self, step: str, args: tuple, training: bool) -> tuple[pp.PipelineRunner, dict, int]:
        lm = self.lightning_module
        for part in self.model_parts:
            part.train(lm.training)
        with captured_log(lm, None):
            call = pp.capture_call(self._module, lambda: getattr(lm, step)(*args), what=f"{step}")
        inputs = self.pipeline_inputs(pp.model_inputs_as_kwargs(self._module, *call))
        batch_size = max(t.shape[0] for t in inputs.values() if isinstance(t, Tensor) and t.dim() > 0)
        return self._runner(batch_size, training), inputs, batch_size

    def pipeline_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The pipelined call's arguments before they are split into micro-batches (context parallel adds the
        global positions here)."""
        return inputs

    def _run_step_per_microbatch(self, step: str, args: tuple, batch_size: int, capture: LogCapture) -> Any:
        def run(output: Any, target: Tensor) -> Any:
            start, stop = int(target[0]), int(target[-1]) + 1
            microbatch = slice_batch(args[0], start, stop, batch_size)
            with captured_log(self.lightning_module, capture), pp.substituted_forward(self._module, output, step):
                return getattr(self.lightning_module, step)(microbatch, *args[1:])

        return run

    def pipelined_training_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        """A training step through the schedule, which runs forward and backward per micro-batch."""
        trainer = self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        step_args = (batch, batch_idx, *args)
        runner, inputs, batch_size = self._pipelined_call("training_step", step_args, True)
        if not self._warned_labels and (counts := uneven_label_counts(inputs.get("labels"), runner.n_microbatches)):
            self._warned_labels = True
            rank_zero_warn(
                f"pipeline: the micro-batches hold {counts} labels other than -100 (ignore_index). A loss averaged"
                " over each micro-batch's tokens (Hugging Face's labels=) then differs from the whole batch's: the"
                " pipeline averages the micro-batch means. Equal counts per micro-batch make them equal."
            )
        calls: list[tuple[Tensor, LogCapture]] = []
        metrics = MetricSteps(self.lightning_module)

        def loss_fn(output: Any, target: Tensor) -> Tensor:
            capture = LogCapture()
            with metrics.call():
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
        metrics.finish(len(calls))
        loss = torch.stack([c[0] for c in calls]).mean() if calls else torch.zeros((), device=self.root_device)
        return self._share_logs(LogCapture.merge([c[1] for c in calls]), loss)

    def sum_tied_gradients(self) -> None:
        """Sum the gradients of a weight tied across stages over its copies (after backward, before clipping)."""
        pp.all_reduce_tied_gradients(self._module, self._ties, self._tie_groups, self._tie_layouts_agree)

    def pipelined_eval_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        """An evaluation step through the schedule's forward-only pass."""
        runner, inputs, batch_size = self._pipelined_call(step, args, False)
        capture, outputs, metrics = LogCapture(), [], MetricSteps(self.lightning_module)
        run = self._run_step_per_microbatch(step, args, batch_size, capture)

        def step_fn(output: Any, target: Tensor) -> Any:
            with metrics.call():
                return run(output, target)

        self._step_fn = step_fn
        runner.eval(inputs, target=torch.arange(batch_size, device=self.root_device), losses=outputs)
        metrics.finish(len(metrics.calls))
        if step == "predict_step":
            return join_outputs(outputs) if runner.holds_last_stage else None
        self._share_logs(capture, None)
        return None

    def _share_logs(self, capture: LogCapture, loss: Tensor | None) -> Tensor | None:
        """Log on every rank what the loss stage's step logged (combined over micro-batches); return its loss."""
        group = self.process_group("pp")
        if self._log_groups is None:  # once: the mesh does not change between steps
            names = ("batch", "loss", "fsdp", "dp_shard", "cp", "tp")
            self._log_groups = {name: self.process_group(name) for name in names}
        module, device = self.lightning_module, self.root_device
        return share_logs(module, capture, loss, group, self.loss_stage, device, self._log_groups)


def uneven_label_counts(labels: Any, n_microbatches: int, ignore_index: int = -100) -> list[int] | None:
    """The number of labels other than ``ignore_index`` in each micro-batch of ``labels``, or ``None`` when they are
    all equal (or ``labels`` is not an integer tensor): only equal counts make the mean of per-micro-batch token means
    the whole batch's token mean."""
    if not isinstance(labels, Tensor) or labels.dim() == 0 or labels.is_floating_point():
        return None
    counts = [int((chunk != ignore_index).sum()) for chunk in torch.tensor_split(labels, n_microbatches)]
    return counts if len(set(counts)) > 1 else None


_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm)


def warn_batch_norm_per_microbatch(
    model: torch.nn.Module, microbatches: int, batch_size: int, accumulate: int = 1
) -> None:
    """Say that BatchNorm layers normalize (and update their running statistics) per micro-batch (``batch_size``:
    the per-replica batch; ``accumulate``: the Trainer's accumulate_grad_batches)."""
    names = [name for name, module in model.named_modules() if isinstance(module, _BATCH_NORMS) and module.training]
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        rank_zero_warn(
            f"pipeline: BatchNorm ({shown}) normalizes each micro-batch of {batch_size // microbatches} samples on"
            f" its own and updates its running statistics {microbatches} times per batch: it trains as one process"
            f" with accumulate_grad_batches={microbatches * accumulate} over batches of {batch_size // microbatches}"
            f" would, not as one over whole batches of {batch_size}. Fewer micro-batches (n_microbatches=) make them"
            " larger; LayerNorm or GroupNorm do not depend on the batch."
        )


def slice_batch(batch: Any, start: int, stop: int, batch_size: int) -> Any:
    """Rows ``start:stop`` of every tensor (dim 0 of size ``batch_size``) and list/tuple of ``batch_size`` items in
    ``batch``, recursively through dicts, lists and tuples; everything else is kept whole."""
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == batch_size else batch
    if isinstance(batch, dict):
        return type(batch)({k: slice_batch(v, start, stop, batch_size) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        if len(batch) == batch_size and not any(isinstance(v, (Tensor, dict, list, tuple)) for v in batch):
            return batch[start:stop]
        items = [slice_batch(v, start, stop, batch_size) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def join_outputs(outputs: list[Any]) -> Any:
    """Per-micro-batch outputs of ``predict_step`` back in batch order: tensors concatenated along dim 0 (also
    inside dicts, lists and tuples); otherwise the list of outputs."""
    first = outputs[0] if outputs else None
    if isinstance(first, Tensor) and first.dim() > 0:
        return torch.cat(outputs)
    if isinstance(first, dict):
        return type(first)({k: join_outputs([o[k] for o in outputs]) for k in first})
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        return type(first)(join_outputs([o[i] for o in outputs]) for i in range(len(first)))
    return outputs
