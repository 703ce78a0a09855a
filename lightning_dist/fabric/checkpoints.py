"""``fabric.save`` / ``fabric.load`` in the Trainer strategies' checkpoint format.

A Fabric state (``{"model": model, "optimizer": optimizer, "step": 4, ...}``) is written as the Trainer writes its
checkpoint: the model's state under ``state_dict``, each optimizer's under ``optimizer_<i>`` (DCP shards, or one
file with :class:`~lightning_dist.plugins.FullStateCheckpointIO`, where the model's state is also under its own key,
``"model"``, as Fabric's own one-file checkpoints hold it), everything else in ``meta.pt`` with the
provenance, the checksums and the atomic publish of the checkpoint IO plugin. The provenance records which state
keys held the model and the optimizers. So a Fabric checkpoint resumes on any mesh and strategy, loads into a
Trainer's model (and back: the model's keys may differ by the LightningModule's attribute prefix), and is read with
``weights_only`` unpickling unless the caller opts out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer

from lightning_dist.checkpoint import model_state as states
from lightning_dist.checkpoint.layout import PROVENANCE_KEY, CheckpointError
from lightning_dist.checkpoint.safe_load import resolve_weights_only
from lightning_dist.compat.lightning import Stateful

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

#: The provenance entry naming the Fabric state's keys: ``{"model": key, "optimizers": [keys]}``.
FABRIC_STATE_KEY = "fabric_state"
#: Keys of Lightning's checkpoint layout a Fabric state cannot use for its own entries.
RESERVED_KEYS = ("state_dict", "optimizer_states", PROVENANCE_KEY)


def save_state(
    engine: MeshParallelStrategy,
    path: Path,
    state: dict[str, Any],
    filter: dict[str, Callable[[str, Any], bool]] | None = None,
) -> None:
    """Write ``state`` (one model, its optimizers, anything else) to ``path`` through the engine's checkpoint IO.
    Collective."""
    model_key, model, optimizer_keys = _split(state, "save")
    full, stages = engine.checkpoint_io.full_state, engine.stage_layout
    checkpoint: dict[str, Any] = {}
    for key, value in state.items():
        if key != model_key and key not in optimizer_keys:
            checkpoint[key] = value.state_dict() if isinstance(value, Stateful) else value
    checkpoint["state_dict"] = _filtered(filter, model_key, states.model_state(model, full=full, stages=stages))
    checkpoint["optimizer_states"] = [
        states.optimizer_state(model, state[key], full=full, stages=stages) for key in optimizer_keys
    ]
    if full:  # one file: the model also under its own key, as Fabric writes it (litgpt reads `["model"]`), no copy
        checkpoint[model_key] = checkpoint["state_dict"]
    provenance = engine.checkpoint_provenance()
    provenance[FABRIC_STATE_KEY] = {"model": model_key, "optimizers": optimizer_keys}
    checkpoint[PROVENANCE_KEY] = provenance
    engine.checkpoint_io.save_checkpoint(checkpoint, path)


def load_state(
    engine: MeshParallelStrategy,
    path: Path,
    state: Module | dict[str, Any],
    strict: bool = True,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Restore ``state`` (a model alone, or a Fabric state dict) in place from a Fabric or Trainer checkpoint of either
    format, saved on any mesh; returns what the checkpoint holds beyond the requested keys. Collective."""
    if isinstance(state, Optimizer):
        raise TypeError(
            "fabric.load(path, optimizer) cannot restore an optimizer alone: pass the state with its model,"
            " fabric.load(path, {'model': model, 'optimizer': optimizer})."
        )
    if isinstance(state, Module):
        model, optimizers, requested = state, [], []
    else:
        model_key, model, optimizer_keys = _split(state, "load")
        optimizers = [state[key] for key in optimizer_keys]
        requested = [key for key in state if key != model_key and key not in optimizer_keys]
    metadata = states.load_checkpoint_into(
        path, model, optimizers, strict, engine.stage_layout, weights_only=resolve_weights_only(weights_only)
    )
    provenance = metadata.pop(PROVENANCE_KEY, None)
    recorded = provenance.get(FABRIC_STATE_KEY) if isinstance(provenance, dict) else None
    if isinstance(recorded, dict) and isinstance(metadata.get(recorded.get("model")), dict):
        metadata.pop(recorded["model"])  # the one-file format's second name of the model state
    missing = [key for key in requested if key not in metadata]
    if strict and missing:
        raise KeyError(
            f"The checkpoint {str(path)!r} holds no {missing} (it has {sorted(metadata)}). Load with strict=False to"
            " leave them as they are."
        )
    assert isinstance(state, dict) or not requested
    for key in requested:
        if key not in metadata:
            continue
        value = metadata.pop(key)
        if isinstance(state[key], Stateful):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return metadata


def _split(state: dict[str, Any], verb: str) -> tuple[str, Module, list[str]]:
    """The key of the one model of ``state`` and the keys of its optimizers, in order."""
    reserved = [key for key in RESERVED_KEYS if key in state]
    if reserved:
        raise ValueError(
            f"fabric.{verb}: the state keys {reserved} are where the checkpoint keeps the model, optimizers and"
            " provenance. Rename these entries."
        )
    models = [key for key, value in state.items() if isinstance(value, Module)]
    if len(models) != 1:
        raise ValueError(
            f"fabric.{verb} with a lightning_dist strategy takes exactly one model in the state (found"
            f" {models or 'none'}): {{'model': model, 'optimizer': optimizer, ...}}. Save several models to separate"
            " paths."
        )
    optimizers = [key for key, value in state.items() if isinstance(value, Optimizer)]
    return models[0], state[models[0]], optimizers


def _filtered(
    filter: dict[str, Callable[[str, Any], bool]] | None, model_key: str, model_state: dict[str, Any]
) -> dict[str, Any]:
    keep = (filter or {}).get(model_key)
    if keep is None:
        return model_state
    kept = {name: value for name, value in model_state.items() if keep(name, value)}
    if model_state and not kept:  # a full-state save holds the tensors on rank 0 only
        raise CheckpointError(f"fabric.save: the filter of {model_key!r} leaves none of the model's tensors.")
    return kept
