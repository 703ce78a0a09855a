"""The step protocol of a lightning_dist strategy (a mixin of the shared base): how Lightning's training,
evaluation and optimizer steps reach the parallelized model. This is the one place that states the order of a
step, for every mesh. Each parallelism contributes a :class:`~.steps.part.StepPart` (see :data:`STEP_PARTS`); the
parts whose axis has more than one rank take part, in this order:

A training step
    1. ``batch_to_device`` → :meth:`StepProtocol.transform_batch`: context parallel shards the sequences.
    2. :meth:`StepProtocol.train_context`, open from forward to the end of backward (activation checkpointing
       recomputes forward inside backward): context parallel's attention dispatch, loss parallel's cross-entropy.
    3. The precision plugin's autocast.
    4. :meth:`StepProtocol.run_training_step`, each part wrapping the next: context parallel (the shard's global
       positions, the first output checked for a sequence dim) → tensor parallel (a loss-parallel failure explained,
       the loss checked to be local) → forward and backward: the pipeline's schedule, per micro-batch (the loss of
       each scaled by micro-batches × accumulation), or else the root module's forward (so FSDP's root hooks run)
       and then :meth:`StepProtocol.run_backward`, Lightning's (precision plugin, loss scaling).
    5. :meth:`StepProtocol.optimizer_step`'s closure, after backward: the pipeline sums a tied weight's gradients
       over its stages → parameters resharded → tensor-parallel gradients made consistent → ``on_nonfinite``.
    6. Lightning: gradient clipping (the precision plugin's global norm, over the pipeline stages too) → the
       optimizer's step → ``float8='tensorwise'`` under FSDP2: the FP8 all-gather scales of the next forward.

An evaluation step (validation, test, predict)
    1. :meth:`StepProtocol.transform_batch`, as above.
    2. The precision plugin's evaluation context.
    3. :meth:`StepProtocol.run_eval_step`, each part wrapping the next: context parallel (attention dispatch,
       global positions, first-output check; predictions gathered back to whole sequences) → the pipeline's
       forward-only pass, or else the root module's forward.
    4. At the end of the loop, every model part resharded (after each validation step with ``WeightAveraging``,
       whose ``on_validation_epoch_end`` copies into the sharded parameters before the loop ends).

A strategy written by hand may still override the hooks above (``train_context``, ``run_training_step``,
``run_backward``, ``run_eval_step``, ``transform_batch``); the parallelisms of this package do not.
``on_nonfinite``: what every rank does when any rank sees a non-finite loss or gradient (skip or stop).
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dist.compat.lightning import forward_redirection
from lightning_dist.parallel.fsdp import reshard_all
from lightning_dist.parallel.gradient_sync import AccumulationSync, deferred_gradient_sync
from lightning_dist.parallel.replicated_state import average_gradients, sum_gradients
from lightning_dist.parallel.runtime.nonfinite import NonFiniteError, gather_non_finite, gradients_are_finite
from lightning_dist.parallel.tensor_parallel import shard_gradients_like_parameters
from lightning_dist.strategies.steps.context_parallel import ContextParallelPart
from lightning_dist.strategies.steps.expert_parallel import ExpertParallelPart
from lightning_dist.strategies.steps.part import StepPart
from lightning_dist.strategies.steps.pipeline import PipelinePart
from lightning_dist.strategies.steps.tensor_parallel import TensorParallelPart

NonFiniteMode = Literal["ignore", "skip", "stop"]

#: The parts of a step, outermost first (see the module docstring for what each does where).
STEP_PARTS: tuple[type[StepPart], ...] = (ExpertParallelPart, ContextParallelPart, TensorParallelPart, PipelinePart)


class StepProtocol:
    """Training, evaluation and optimizer steps of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    _train_context: ExitStack | None = None
    on_nonfinite: NonFiniteMode = "ignore"
    #: Optimizer steps skipped by ``on_nonfinite="skip"`` in this process.
    skipped_non_finite_steps: int = 0

    def step_parts(self) -> list[StepPart]:
        """The parts of this strategy's steps on its mesh, in :data:`STEP_PARTS`'s order."""
        return [kind(self) for kind in STEP_PARTS if kind.applies_to(self)]

    def _step_runner(self, parts: list[StepPart]) -> StepPart | None:
        """The part that runs forward and backward itself (the pipeline), if any."""
        return next((part for part in parts if part.runs_steps), None)

    def transform_batch(self, batch: Any, dataloader_idx: int = 0) -> Any:
        """Transform a batch after it reached the device (context parallel shards it on the sequence dim)."""
        for part in self.step_parts():
            batch = part.transform_batch(batch, dataloader_idx)
        return batch

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.transform_batch(batch, dataloader_idx)

    def train_context(self) -> ExitStack:
        """Contexts that must stay active from a training step's forward to the end of its backward: the parts'. A
        strategy adds its own to the stack ``super().train_context()`` returns. (Precision's autocast is entered
        around the forward only, as torch recommends.)"""
        stack = ExitStack()
        for part in self.step_parts():
            for context in part.train_contexts():
                stack.enter_context(context)
        return stack

    def run_training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the training step: the parts' wrappers around the schedule of a part that runs it (pipeline), or
        around the root module's ``__call__`` (so FSDP's root hooks run)."""
        parts = self.step_parts()
        runner = self._step_runner(parts)
        if runner is not None:
            run = runner.run_training_step
        else:
            run = functools.partial(forward_redirection(self), self.model, self.lightning_module, "training_step")
        for part in reversed(parts):
            run = part.wrap_training_step(run)
        return run(*args, **kwargs)

    def run_backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The backward of a training step, inside :meth:`train_context`: Lightning's (precision plugin, loss
        scaling), unless a part's schedule already ran it."""
        runner = self._step_runner(self.step_parts())
        if runner is not None:
            return runner.run_backward(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def run_eval_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``validation_step``/``test_step``/``predict_step``: the parts' wrappers around a part's forward-only
        schedule (pipeline), or around the root module's ``__call__`` (so FSDP's root hooks gather its
        parameters)."""
        parts = self.step_parts()
        runner = self._step_runner(parts)
        if runner is not None:
            run = functools.partial(runner.run_eval_step, step)
        else:
            run = functools.partial(forward_redirection(self), self.model, self.lightning_module, step)
        for part in reversed(parts):
            run = part.wrap_eval_step(step, run)
        return run(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._close_train_context()  # the previous step's, if its backward was skipped (training_step gave None)
        self._train_context = self.train_context()
        try:
            with self.precision_plugin.train_step_context():
                return self.run_training_step(*args, **kwargs)
        except BaseException:
            self._close_train_context()
            raise

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return self.run_backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._close_train_context()

    def _close_train_context(self) -> None:
        context, self._train_context = self._train_context, None
        if context is not None:
            context.close()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            output = self.run_eval_step("validation_step", *args, **kwargs)
        if self.sharded_parameters_at_validation_end():
            self._reshard_after_evaluation()
        return output

    def sharded_parameters_at_validation_end(self) -> bool:
        """Whether a callback's ``on_validation_epoch_end``, which comes before the strategy's ``on_validation_end``,
        needs the parameters sharded: each validation step then reshards (see
        :class:`~lightning_dist.strategies.weight_averaging.WeightAveragingSetup`)."""
        return False

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self.run_eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self.run_eval_step("predict_step", *args, **kwargs)

    @property
    def accumulation_sync_mode(self) -> AccumulationSync:
        """When gradients are communicated during gradient accumulation (see :mod:`.parallel.gradient_sync`)."""
        return "every"

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this around every micro-batch but the last of an accumulation window.
        with deferred_gradient_sync(self.model, self.accumulation_sync_mode):
            yield

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # The closure runs forward/backward; gathered parameters must not outlive it into the update.
        parts = self.step_parts()

        def closure_then_reshard() -> Any:
            result = closure()
            for part in parts:  # before clipping (pipeline: a tied weight's gradients summed over its stages)
                part.after_backward()
            reshard_all(self.model)
            if self._tp_sharded:  # before clipping and the update (see shard_gradients_like_parameters)
                shard_gradients_like_parameters(self._tp_sharded)
            if self._tp_partial:  # per-head norms: each tp rank holds its heads' part of the gradient
                sum_gradients(self._tp_partial, self.process_group("tp"))
            if self._tp_replicated:  # before clipping and the update: the copies must see identical gradients
                average_gradients(self._tp_replicated, self.process_group("tp"))
            if self.on_nonfinite != "ignore":
                self._guard_non_finite(result, optimizer)
            return result

        output = super().optimizer_step(optimizer, closure_then_reshard, model, **kwargs)
        self.float8_after_optimizer_step()  # tensorwise under FSDP2: the next forward's FP8 all-gather scales
        return output

    def float8_after_optimizer_step(self) -> None:
        """After every optimizer step (see :class:`~lightning_dist.strategies.float8_setup.Float8Setup`)."""

    def _guard_non_finite(self, loss: Any, optimizer: Any) -> None:
        """``on_nonfinite``: after backward, before clipping and the update, every rank learns which ranks saw a
        non-finite loss or gradient; then all stop, or all drop their gradients so that the optimizer skips the
        step. Under ``16-mixed`` the loss scaler already skips overflowing steps: only the loss is checked."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        loss_finite = not isinstance(loss, Tensor) or bool(torch.isfinite(loss.detach()).all())
        grads_finite = getattr(self.precision_plugin, "scaler", None) is not None or gradients_are_finite(params)
        report = gather_non_finite(loss_finite, grads_finite, self.root_device)
        if not report.found:
            return
        trainer = self.lightning_module.trainer
        where = (
            f"at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {trainer.fit_loop.batch_idx})"
        )
        if self.on_nonfinite == "stop":
            raise NonFiniteError(
                f"Training stopped {where}: {report.describe()} (on_nonfinite='stop'). Look at that batch, lower the"
                " learning rate, clip gradients (Trainer(gradient_clip_val=...)), or pass on_nonfinite='skip' to skip"
                " such steps."
            )
        for p in params:  # optimizers leave parameters without a gradient untouched (state and step count included)
            p.grad = None
        self.skipped_non_finite_steps += 1
        rank_zero_warn(f"Skipped the optimizer step {where} on every rank: {report.describe()} (on_nonfinite='skip').")

    def _reshard_after_evaluation(self) -> None:
        for part in self.model_parts:
            reshard_all(part)

    @override
    def on_validation_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_test_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_predict_end(self) -> None:
        self._reshard_after_evaluation()
