"""The step protocol of a lightning_dist strategy (a mixin of the shared base): how Lightning's training,
evaluation and optimizer steps reach the parallelized model, and where a strategy takes a step over.

* :meth:`StepProtocol.train_context`: contexts that stay active from a training step's forward to the end of its
  backward (loss parallel's cross-entropy, context parallel's attention dispatch): activation checkpointing
  recomputes forward inside backward, so a context that closed with the forward would miss the recompute.
* :meth:`StepProtocol.run_training_step` and :meth:`StepProtocol.run_backward`: a strategy whose schedule runs
  forward and backward itself (pipeline) overrides both.
* :meth:`StepProtocol.run_eval_step`: validation, test and predict steps (pipeline: a forward-only schedule).
* :meth:`StepProtocol.transform_batch`: a batch after it reached the device (context parallel: sequence shards).
* ``on_nonfinite``: what every rank does when any rank sees a non-finite loss or gradient (skip or stop).
"""

from __future__ import annotations

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
from lightning_dist.parallel.nonfinite import NonFiniteError, gather_non_finite, gradients_are_finite
from lightning_dist.parallel.replicated_state import average_gradients
from lightning_dist.parallel.tensor_parallel import shard_gradients_like_parameters

NonFiniteMode = Literal["ignore", "skip", "stop"]


class StepProtocol:
    """Training, evaluation and optimizer steps of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    _train_context: ExitStack | None = None
    on_nonfinite: NonFiniteMode = "ignore"
    #: Optimizer steps skipped by ``on_nonfinite="skip"`` in this process.
    skipped_non_finite_steps: int = 0

    def transform_batch(self, batch: Any, dataloader_idx: int = 0) -> Any:
        """Transform a batch after it reached the device (context parallel shards it on the sequence dim)."""
        return batch

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.transform_batch(batch, dataloader_idx)

    def train_context(self) -> ExitStack:
        """Contexts that must stay active from a training step's forward to the end of its backward. Subclasses add
        theirs to the stack ``super().train_context()`` returns. (Precision's autocast is entered around the
        forward only, as torch recommends.)"""
        return ExitStack()

    def run_training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the training step through the root module's ``__call__`` (so FSDP's root hooks run). A strategy that
        takes the step over (pipeline: forward and backward inside its schedule) overrides this and
        :meth:`run_backward`."""
        return forward_redirection(self)(self.model, self.lightning_module, "training_step", *args, **kwargs)

    def run_backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The backward of a training step, inside :meth:`train_context`: Lightning's (precision plugin, loss
        scaling). A strategy whose schedule already ran backward (pipeline) overrides this."""
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def run_eval_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``validation_step``/``test_step``/``predict_step`` through the root module's ``__call__`` (so FSDP's
        root hooks gather its parameters). A strategy that evaluates differently (pipeline) overrides this."""
        return forward_redirection(self)(self.model, self.lightning_module, step, *args, **kwargs)

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
            return self.run_eval_step("validation_step", *args, **kwargs)

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
        def closure_then_reshard() -> Any:
            result = closure()
            reshard_all(self.model)
            if self._tp_sharded:  # before clipping and the update (see shard_gradients_like_parameters)
                shard_gradients_like_parameters(self._tp_sharded)
            if self._tp_replicated:  # before clipping and the update: the copies must see identical gradients
                average_gradients(self._tp_replicated, self.process_group("tp"))
            if self.on_nonfinite != "ignore":
                self._guard_non_finite(result, optimizer)
            return result

        return super().optimizer_step(optimizer, closure_then_reshard, model, **kwargs)

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
        if self.model is not None:
            reshard_all(self.model)

    @override
    def on_validation_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_test_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_predict_end(self) -> None:
        self._reshard_after_evaluation()
