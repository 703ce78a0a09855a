"""Optimizers whose param groups hold no parameter, in checkpoints.

Under a pipeline each stage's optimizer holds only its stage's parameters, so a param group of the user's optimizer
is empty on a stage that holds none of its parameters, and a stage with nothing to optimize has an optimizer with
one empty group (see :mod:`lightning_dist.parallel.pipeline.stage_optimizers`). torch's state-dict functions
(``torch.distributed.checkpoint.state_dict``, torch 2.13) refuse both: an optimizer without parameters has "empty"
state, and a state keyed per parameter cannot be loaded into an empty group (its options are read from its first
parameter). Such groups are set aside while torch saves or loads, and get their options back from a stage that
holds parameters of the same group.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer

_NOT_OPTIONS = ("params", "param_names")  # what a param group holds besides its options


def holds_parameters(optimizer: Optimizer) -> bool:
    """Whether any param group of ``optimizer`` holds a parameter."""
    return any(group["params"] for group in optimizer.param_groups)


@contextmanager
def empty_groups_set_aside(optimizer: Optimizer) -> Generator[list[int], None, None]:
    """While open, ``optimizer.param_groups`` holds only the groups with parameters (unless none has any); yields
    the positions of the empty ones, which are put back there afterwards (``load_state_dict`` replaces the others)."""
    groups = optimizer.param_groups
    empty = [i for i, group in enumerate(groups) if not group["params"]]
    if not empty or len(empty) == len(groups):
        yield empty
        return
    optimizer.param_groups = [group for group in groups if group["params"]]
    try:
        yield empty
    finally:
        restored = list(optimizer.param_groups)
        for i in empty:  # ascending: each lands at its original position
            restored.insert(i, groups[i])
        optimizer.param_groups = restored


def share_group_options(optimizer: Optimizer, group: dist.ProcessGroup) -> None:
    """Give every empty param group of ``optimizer`` the options (``lr``, ``betas``...) of the same group on a rank
    of ``group`` where it holds parameters: group ``i`` is the same group of the user's optimizer on every stage.
    Collective over ``group`` (every rank calls it, with or without empty groups)."""
    mine = [
        None if not g["params"] else {k: v for k, v in g.items() if k not in _NOT_OPTIONS}
        for g in optimizer.param_groups
    ]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for i, own in enumerate(optimizer.param_groups):
        if own["params"]:
            continue
        source = next((options[i] for options in everyone if i < len(options) and options[i] is not None), None)
        if source is not None:
            own.update(source)
