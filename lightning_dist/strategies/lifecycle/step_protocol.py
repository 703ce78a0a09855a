"""The step protocol of a lightning_dist strategy (a mixin of the shared base): how Lightning's training,
evaluation and optimizer steps reach the parallelized model. This is the one place that states the order of a
step, for every mesh. Each parallelism's mixin declares a :class:`~.step_part.StepPart`, found in the strategy's class
chain (:func:`~.step_part.declared_step_parts`); the parts whose axis has more than one rank take part, in
:data:`PART_ORDER`:

A training step
    1. ``batch_to_device`` → :meth:`StepProtocol.transform_batch`: context parallel shards the sequences.
    2. :meth:`StepProtocol.train_context`, open from forward to the end of backward (activation checkpointing
       recomputes forward inside backward): a Hugging Face model's key/value cache off (``use_cache=False``),
       context parallel's attention dispatch, loss parallel's cross-entropy.
    3. The precision plugin's autocast.
    4. :meth:`StepProtocol.run_training_step`, each part wrapping the next: context parallel (the shard's global
       positions, the first output checked for a sequence dim) → tensor parallel (a loss-parallel failure explained,
       the loss checked to be local) → forward and backward: the pipeline's schedule, per micro-batch (the loss of
       each scaled by micro-batches × accumulation), or else the root module's forward (so FSDP's root hooks run)
       and then :meth:`StepProtocol.run_backward`, Lightning's (precision plugin, loss scaling).
    5. :meth:`StepProtocol.optimizer_step`'s closure, after backward: the pipeline sums a tied weight's gradients
       over its stages → fault tolerance averages the gradients over the live replica groups → parameters resharded
       → tensor-parallel gradients made consistent → ``on_nonfinite`` → the step's commit: every part is asked
       whether the update is applied (fault tolerance: whether torchft commits the step), and a no drops the
       gradients. (Fault tolerance forms the step's quorum before the batch, in ``on_train_batch_start``.)
    6. Lightning: gradient clipping (the precision plugin's global norm, over the pipeline stages too) → the
       optimizer's step → ``float8='tensorwise'`` under FSDP2: the FP8 all-gather scales of the next forward.

A manual-optimization step (``automatic_optimization = False``)
    Steps 1 to 4, with :meth:`StepProtocol.train_context` open until ``training_step`` returns: every forward of the
    step runs inside it. Each ``manual_backward`` (:meth:`StepProtocol.run_manual_backward`) first ends FSDP2's
    forward pass on its loss (the whole step is the root module's forward), then runs the backward and makes the
    gradients consistent over tp (step 5's tensor-parallel part, on this backward's share); each optimizer step
    reshards, then gathers again the parameters the root module holds itself, for the rest of the step.

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
``on_nonfinite``: what every rank does when any rank sees a non-finite loss or gradient (skip or stop). The first
training step's loss is checked whatever the setting: a run that starts from NaN is said to, loudly.
"""

from __future__ import annotations

import functools
from collections.abc import Generator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dist.compat.hugging_face import generation_cache_off
from lightning_dist.compat.lightning import forward_redirection
from lightning_dist.parallel.fsdp import (
    end_forward_before_backward,
    gather_root,
    reshard_all,
    toggled_while_gathered,
)
from lightning_dist.parallel.gradient_sync import AccumulationSync, deferred_gradient_sync
from lightning_dist.strategies.lifecycle.nonfinite_guard import NonFiniteGuard
from lightning_dist.strategies.lifecycle.peer_batches import PeerBatches
from lightning_dist.strategies.lifecycle.step_part import StepPart, declared_step_parts

#: The order in which the parallelisms' parts act in a step, outermost first, by their mesh axis (see the module
#: docstring for what each does where). A part of an axis not named here acts after these, in class-chain order.
PART_ORDER: tuple[str, ...] = ("ep", "cp", "tp", "pp")


class StepProtocol(NonFiniteGuard, PeerBatches):
    """Training, evaluation and optimizer steps of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    _train_context: ExitStack | None = None
    #: Whether a training step runs now: a backward inside it is ``manual_backward`` (manual optimization).
    _in_training_step: bool = False
    #: The Hugging Face configs whose key/value cache is turned off while a training step runs (set at setup).
    _generation_caches: tuple[Any, ...] = ()

    def step_parts(self) -> list[StepPart]:
        """The parts of this strategy's steps on its mesh, in :data:`PART_ORDER`."""
        return [kind(self) for kind in declared_step_parts(type(self), PART_ORDER) if kind.applies_to(self)]

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
        if self._generation_caches:
            stack.enter_context(generation_cache_off(self._generation_caches))
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
        self._in_training_step = True
        try:
            with self.precision_plugin.train_step_context():
                output = self.run_training_step(*args, **kwargs)
            if not self._first_loss_checked:
                self._first_loss_checked = True
                self._check_first_loss(output)
        except BaseException:
            self._close_train_context()
            raise
        finally:
            self._in_training_step = False
        # the step is over: its backwards ran inside it (manual optimization), or a part's schedule ran backward too
        if not self.lightning_module.automatic_optimization or self._step_runner(self.step_parts()) is not None:
            self._close_train_context()
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self._in_training_step:
            return self.run_manual_backward(closure_loss, optimizer, *args, **kwargs)
        try:
            return self.run_backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._close_train_context()

    def run_manual_backward(self, loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """``manual_backward`` (manual optimization): a backward inside the training step, which goes on after it
        in the same :meth:`train_context`. FSDP2's forward pass (the whole step is the root module's forward) is
        finished on ``loss`` first, so that the backward reduces every unit's gradients; after it the gradients are
        made consistent over tp, as an automatic step's closure makes them, so that what the step does next
        (``clip_gradients``, the optimizer's step, another backward) sees what one process would."""
        self._check_root_parameters_untoggled()
        for part in self.model_parts:
            end_forward_before_backward(part, loss)
        parts = self.step_parts()
        with ExitStack() as stack:  # tensor parallel: gradients summed over tp, only this backward's part may be
            for step_part in parts:
                stack.enter_context(step_part.manual_backward_context())
            output = self.run_backward(loss, optimizer, *args, **kwargs)
            for step_part in parts:
                step_part.make_gradients_consistent()
        for part in self.model_parts:  # the backward resharded the root
            gather_root(part)
        return output

    def _check_root_parameters_untoggled(self) -> None:
        toggled = toggled_while_gathered(self.model, self._root_parameters)
        if toggled:
            raise RuntimeError(
                f"{self.log_name}: requires_grad of {', '.join(toggled)} changed during the training step"
                " (toggle_optimizer / untoggle_optimizer): these are parameters of the LightningModule itself, not of"
                " a submodule, and FSDP2 keeps them gathered for the whole training step in copies that do not see"
                " the change, so this step would compute other gradients than one process. Hold them in a submodule"
                " whose forward uses them (gathered, with the current requires_grad, at each call), or do not toggle"
                " optimizers."
            )

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
        :class:`~lightning_dist.strategies.lifecycle.weight_averaging.WeightAveragingSetup`)."""
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
            if self.lightning_module.automatic_optimization:  # manual: after each manual_backward
                for part in parts:  # tensor parallel: gradients made consistent over tp
                    part.make_gradients_consistent()
            if self.on_nonfinite != "ignore":
                self._guard_non_finite(result, optimizer)
            if not all(part.commits_optimizer_step() for part in parts):  # every part asked (fault tolerance)
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.grad = None
            return result

        output = super().optimizer_step(optimizer, closure_then_reshard, model, **kwargs)
        self.float8_after_optimizer_step()  # tensorwise under FSDP2: the next forward's FP8 all-gather scales
        if self._in_training_step:  # manual optimization: the step goes on, reading the root's own parameters
            for part in self.model_parts:
                gather_root(part)
        return output

    def float8_after_optimizer_step(self) -> None:
        """After every optimizer step (see :class:`~lightning_dist.strategies.lifecycle.float8.Float8Setup`)."""

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
