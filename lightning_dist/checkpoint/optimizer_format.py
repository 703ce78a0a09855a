"""Optimizer states in two formats: keyed by parameter name (torch.distributed.checkpoint's ``get_optimizer_state_dict``)
and keyed by parameter position (``torch.optim.Optimizer.state_dict``, what a one-device Lightning checkpoint holds).

Positions count parameters across ``param_groups`` in order, exactly as ``Optimizer.state_dict`` numbers them, so a
single-file checkpoint written from a sharded run resumes in a one-device Lightning run and the other way round.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any


def names_to_positions(state: dict[str, Any]) -> dict[str, Any]:
    """Convert a name-keyed optimizer state to the position-keyed format of ``Optimizer.state_dict``."""
    position: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        group = dict(group)
        ids = []
        for name in group["params"]:
            position.setdefault(name, len(position))
            ids.append(position[name])
        group["params"] = ids
        groups.append(group)
    # An optimizer without per-parameter state (SGD without momentum) has an empty "state", which DCP does not write.
    per_parameter = state.get("state", {})
    return {"state": {position[name]: value for name, value in per_parameter.items()}, "param_groups": groups}


def positions_to_names(state: dict[str, Any], names_in_order: list[list[str]]) -> dict[str, Any]:
    """Convert a position-keyed optimizer state to names, given the parameter names of each param group in order."""
    flat = [name for group in names_in_order for name in group]
    if len(state["param_groups"]) != len(names_in_order):
        raise ValueError(
            f"The checkpoint's optimizer has {len(state['param_groups'])} param groups, the current one"
            f" {len(names_in_order)}: it was configured differently."
        )
    groups = []
    for group, names in zip(state["param_groups"], names_in_order):
        if len(group["params"]) != len(names):
            raise ValueError(
                f"A param group of the checkpoint's optimizer has {len(group['params'])} parameters, the current one"
                f" {len(names)}: it was configured differently."
            )
        group = copy.copy(group)
        group["params"] = [flat[i] for i in group["params"]]
        groups.append(group)
    return {"state": {flat[int(i)]: value for i, value in state["state"].items()}, "param_groups": groups}


def is_name_keyed(state: dict[str, Any]) -> bool:
    params = [p for group in state.get("param_groups", []) for p in group["params"]]
    return bool(params) and isinstance(params[0], str)


def only_names(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The part of a name-keyed optimizer state that concerns ``names`` (one pipeline stage's parameters)."""
    groups = [{**group, "params": [n for n in group["params"] if n in names]} for group in state["param_groups"]]
    return {"state": {n: v for n, v in state["state"].items() if n in names}, "param_groups": groups}


def only_known_group_options(state: dict[str, Any], optimizer_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``state`` without the param-group options the optimizer's groups do not have (yet): what a scheduler created
    later adds, such as ``SWALR``'s ``swa_lr``, which torch's ``set_optimizer_state_dict`` cannot place. A sharded
    load reads only the options the optimizer has, too; the scheduler sets its own again when it is created."""
    if len(state["param_groups"]) != len(optimizer_groups):
        return state  # a different optimizer: left to the load's own error
    groups = [
        {key: value for key, value in saved.items() if key == "params" or key in current}
        for saved, current in zip(state["param_groups"], optimizer_groups)
    ]
    return {**state, "param_groups": groups}


def only_saved_group_options(state: dict[str, Any], index: Iterable[str], prefix: str) -> dict[str, Any]:
    """A DCP load request for an optimizer's state (under ``prefix`` in the checkpoint's ``index`` of keys), without
    the param-group options the checkpoint does not hold for a group it holds: what a scheduler created after the
    save adds, such as ``initial_lr`` (Lightning's learning-rate finder restoring its checkpoint, a scheduler added
    to a resumed run). The loaded group is then the saved one, as ``Optimizer.load_state_dict`` leaves it. Both
    layouts: groups as a list (``param_groups.0.lr``) or keyed per parameter (``param_groups.<name>.lr``)."""
    saved = {key for key in index if key.startswith(f"{prefix}param_groups.")}
    saved_groups = {key.rsplit(".", 1)[0] for key in saved}

    def kept(group_key: str, option: str) -> bool:
        key = f"{prefix}{group_key}.{option}"
        return key in saved or f"{prefix}{group_key}" not in saved_groups

    out = dict(state)
    if isinstance(state.get("param_groups"), list):
        out["param_groups"] = [
            {k: v for k, v in group.items() if k == "params" or kept(f"param_groups.{i}", k)}
            for i, group in enumerate(state["param_groups"])
        ]
    for key in [k for k in state if k.startswith("param_groups.")]:
        group_key, option = key.rsplit(".", 1)
        if not kept(group_key, option):
            del out[key]
    return out


def unsaved_put_back(requested: dict[str, Any], loaded: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """``loaded`` (a state keyed per parameter, read without what the checkpoint lacks) with the entries it lacks put
    back at their current values from ``requested``: torch's loader of that layout reads every state entry and group
    option the optimizer has. Also the names of the group options to remove once it is loaded (those the checkpoint
    holds for no parameter: a scheduler's ``initial_lr`` added after the save), as ``Optimizer.load_state_dict``
    would leave the groups."""
    missing = {key: value for key, value in requested.items() if key not in loaded}
    saved = {key.rsplit(".", 1)[1] for key in loaded if key.startswith("param_groups.")}
    return {**loaded, **missing}, {key.rsplit(".", 1)[1] for key in missing if key.startswith("param_groups.")} - saved
