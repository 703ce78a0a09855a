"""Where a Lightning checkpoint dict holds model states.

Always ``state_dict``. With Lightning's weight-averaging callbacks, two more: ``WeightAveraging`` saves the averaged
weights in ``state_dict`` and moves the model's own to ``current_model_state``; ``StochasticWeightAveraging`` keeps
its averaged copy's state in its callback state, ``callbacks[<state key>]["average_model_state"]``. Each is a whole
model state: sharded saves write all of them as DCP shards (not into ``meta.pt``), and loads put them back where
Lightning's callbacks look for them.

A path is the tuple of keys leading to a model state: ``("state_dict",)``, ``("current_model_state",)``,
``("callbacks", key, "average_model_state")``.
"""

from __future__ import annotations

from typing import Any

StatePath = tuple[str, ...]

MODEL_STATE: StatePath = ("state_dict",)
#: WeightAveraging: the model's own weights while ``state_dict`` holds the averaged ones.
CURRENT_MODEL_STATE: StatePath = ("current_model_state",)
#: StochasticWeightAveraging: the key of its averaged copy's state inside its callback state.
AVERAGE_MODEL_STATE = "average_model_state"
#: Our provenance entry in a sharded checkpoint's ``meta.pt`` listing the model states its shards hold.
SAVED_STATES_KEY = "model_states"


def callback_state_path(state_key: str) -> StatePath:
    """The path of a StochasticWeightAveraging callback's averaged model state (``state_key``: the callback's)."""
    return ("callbacks", state_key, AVERAGE_MODEL_STATE)


def model_state_paths(checkpoint: dict[str, Any]) -> list[StatePath]:
    """The paths of the model states ``checkpoint`` holds, ``state_dict`` first."""
    paths = [MODEL_STATE]
    if isinstance(checkpoint.get(CURRENT_MODEL_STATE[0]), dict):
        paths.append(CURRENT_MODEL_STATE)
    callbacks = checkpoint.get("callbacks")
    for key, state in (callbacks if isinstance(callbacks, dict) else {}).items():
        if isinstance(state, dict) and isinstance(state.get(AVERAGE_MODEL_STATE), dict):
            paths.append(callback_state_path(key))
    return paths


def saved_state_paths(provenance: dict[str, Any]) -> list[StatePath]:
    """The model states a sharded checkpoint's shards hold, from the provenance entry of its ``meta.pt``."""
    saved = provenance.get(SAVED_STATES_KEY) if isinstance(provenance, dict) else None
    return [tuple(path) for path in saved] if saved else [MODEL_STATE]


def get_path(tree: dict[str, Any], path: StatePath) -> Any:
    """The value at ``path`` (``None`` where a key is missing)."""
    value: Any = tree
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def set_path(tree: dict[str, Any], path: StatePath, value: Any) -> None:
    """Put ``value`` at ``path``, creating the dicts on the way, and copying those that exist (so that a dict the
    caller shares with another, such as a callback's state, is not changed)."""
    node = tree
    for key in path[:-1]:
        child = node.get(key)
        node[key] = dict(child) if isinstance(child, dict) else {}
        node = node[key]
    node[path[-1]] = value


def pop_path(tree: dict[str, Any], path: StatePath) -> Any:
    """Remove and return the value at ``path``, copying the dicts on the way as :func:`set_path` does."""
    node = tree
    for key in path[:-1]:
        node[key] = dict(node[key])
        node = node[key]
    return node.pop(path[-1])


def without_model_states(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` without its model states (at every path) and optimizer states; the dicts on the way are
    copied, ``checkpoint`` is left as it is."""
    rest = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
    for path in model_state_paths(rest):
        pop_path(rest, path)
    return rest
