"""Label a :class:`~lightning_dist.profiling.CommCounter`'s records with forward / backward / optimizer phases from
module and optimizer hooks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_dist.profiling.comm import CommCounter

__all__ = ["attach_phase_hooks"]


class _PhaseHooks:
    """Removable handle returned by :func:`attach_phase_hooks`."""

    def __init__(self, counter: CommCounter, handles: list[Any], previous_backward_phase: str | None) -> None:
        self._counter = counter
        self._handles = handles
        self._previous_backward_phase = previous_backward_phase

    def remove(self) -> None:
        """Remove the hooks and restore the counter's ``backward_phase``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._counter.backward_phase = self._previous_backward_phase


def attach_phase_hooks(
    module: nn.Module,
    counter: CommCounter,
    forward: str = "forward",
    backward: str = "backward",
    optimizers: Iterable[torch.optim.Optimizer] = (),
    optimizer: str = "optimizer",
) -> _PhaseHooks:
    """Label collectives with ``forward`` / ``backward`` (/ ``optimizer``) automatically.

    * ``forward``: from a forward pre-hook on ``module`` (prepended) to its forward post-hook, which restores the
      previous label.
    * ``backward``: every collective issued while the autograd engine runs a backward pass (sets
      ``counter.backward_phase``), including hooks and final callbacks queued by FSDP2.
    * ``optimizer``: between the step pre- and post-hooks of the given optimizers.

    Limits: attach *after* ``fully_shard``/parallelisation so the pre-hook runs before FSDP2's pre-forward all-gather
    (hooks run in registration order; both are prepended). Forward recomputation of activation checkpointing runs
    inside backward and is labelled ``backward``. Collectives outside these windows (gradient clipping outside
    ``optimizer.step``, validation without a forward of ``module``) keep the surrounding label.

    Args:
        module: The root module whose forward delimits the forward phase.
        counter: The counter to label.
        forward: Label of the forward phase.
        backward: Label of the backward phase.
        optimizers: Optimizers whose ``step`` delimits the optimizer phase.
        optimizer: Label of the optimizer phase.

    Returns:
        A handle whose ``remove()`` detaches the hooks.
    """
    saved: list[str] = []

    def enter(label: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            saved.append(counter.current_phase)
            counter.set_phase(label)

        return hook

    def leave(*_: Any) -> None:
        if saved:
            counter.set_phase(saved.pop())

    handles = [
        module.register_forward_pre_hook(enter(forward), prepend=True),
        module.register_forward_hook(leave, always_call=True),
    ]
    for opt in optimizers:
        handles.append(opt.register_step_pre_hook(enter(optimizer)))
        handles.append(opt.register_step_post_hook(leave))
    previous = counter.backward_phase
    counter.backward_phase = backward
    return _PhaseHooks(counter, handles, previous)
