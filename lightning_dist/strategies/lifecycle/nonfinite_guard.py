"""What every rank does when any rank sees a non-finite loss or gradient (a mixin of the step protocol):
``on_nonfinite`` at each optimizer step, and the first training loss of a ``fit`` on every setting."""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_dist.parallel.runtime.nonfinite import NonFiniteError, gather_non_finite, gradients_are_finite

NonFiniteMode = Literal["ignore", "skip", "stop"]


class NonFiniteGuard:
    """``on_nonfinite`` of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    on_nonfinite: NonFiniteMode = "ignore"
    #: Optimizer steps skipped by ``on_nonfinite="skip"`` in this process.
    skipped_non_finite_steps: int = 0
    #: Whether the first training step of this ``fit`` has had its loss checked.
    _first_loss_checked: bool = False

    def _check_first_loss(self, output: Any) -> None:
        """The first training step's loss, on every ``on_nonfinite`` setting: when it is not finite on any rank,
        every rank learns it; ``"stop"`` stops there, otherwise a warning names the step and the likely causes."""
        loss = output.get("loss") if isinstance(output, dict) else output
        finite = not isinstance(loss, Tensor) or bool(torch.isfinite(loss.detach()).all())
        report = gather_non_finite(finite, True, self.root_device)
        if not report.found:
            return
        causes = (
            "A run that starts from a non-finite loss usually has parameters or buffers that were never initialized"
            " (a model built under Trainer.init_module(empty_init=True) whose modules have no reset_parameters()), NaN"
            " in the weights it loaded, or a first batch that holds NaN or labels out of range."
        )
        if self.on_nonfinite == "stop":
            raise NonFiniteError(
                f"Training stopped at the first training step, {self._where()}: {report.describe()}"
                f" (on_nonfinite='stop'). {causes}"
            )
        then = {
            "ignore": "Training goes on (on_nonfinite='ignore' checks no later step): pass on_nonfinite='stop' to stop"
            " at such a step, or 'skip' to skip its update.",
            "skip": "Its optimizer step is skipped (on_nonfinite='skip').",
        }[self.on_nonfinite]
        rank_zero_warn(f"The first training loss is not finite, {self._where()}: {report.describe()}. {causes} {then}")

    def _where(self) -> str:
        trainer = self.lightning_module.trainer
        return (
            f"at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {trainer.fit_loop.batch_idx})"
        )

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
        where = self._where()
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
