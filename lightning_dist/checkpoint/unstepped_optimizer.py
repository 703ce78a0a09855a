"""An optimizer that has not stepped yet is left so by a checkpoint, and saved as one.

torch's ``get_optimizer_state_dict`` and ``set_optimizer_state_dict`` (torch 2.13) first give an optimizer without
state one, by stepping it with learning rate 0: Adam's moments become zeros and its step count 1. A checkpoint taken
before the first step (Lightning's learning-rate finder saves one and restores it; so does ``save_checkpoint`` or a
``ModelCheckpoint`` before training) then changed the run that went on: its first real step was Adam's second, with
another bias correction than one process's, where ``Optimizer.state_dict`` leaves the optimizer alone. The checkpoint
also held the made-up state. Here such an optimizer has no state again after the call, and its checkpoint holds its
param groups only, as ``Optimizer.state_dict`` writes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.optim import Optimizer


def has_stepped(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` holds per-parameter state (an entry read through its defaultdict is no state)."""
    return any(optimizer.state.values())


@contextmanager
def left_unstepped(optimizer: Optimizer) -> Iterator[bool]:
    """Around a state-dict call: yields whether ``optimizer`` had not stepped; if it had not, it has no state after."""
    unstepped = not has_stepped(optimizer)
    try:
        yield unstepped
    finally:
        if unstepped:
            optimizer.state.clear()


def without_per_parameter_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with its param groups only (an unstepped optimizer's ``Optimizer.state_dict``), in
    either layout: grouped (``state``, ``param_groups``) or keyed per parameter (``state.<name>.<key>``)."""
    out = {key: value for key, value in state.items() if not key.startswith("state.")}
    if "state" in out:
        out["state"] = {}
    return out
