"""Moving model and optimizer state between a (sharded) model and checkpoint formats, with fit checks.

Pure PyTorch on top of ``torch.distributed.checkpoint.state_dict``: works for FSDP2, DTensor tensor parallel and
plain modules alike, on any number of ranks (DCP reshards on load).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Size
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn import Module
from torch.optim import Optimizer

from lightning_dist.checkpoint.empty_param_groups import empty_groups_set_aside, holds_parameters, share_group_options
from lightning_dist.checkpoint.integrity import checksums_verified_while_read, verify_checksums
from lightning_dist.checkpoint.key_prefix import aligned_module
from lightning_dist.checkpoint.layout import (
    PROVENANCE_KEY,
    CheckpointError,
    is_sharded_checkpoint,
    read_checkpoint_file,
    read_metadata,
)
from lightning_dist.checkpoint.model_fit import FitReport, check_fit, compare_shapes
from lightning_dist.checkpoint.optimizer_format import (
    is_name_keyed,
    names_to_positions,
    only_known_group_options,
    only_names,
    only_saved_group_options,
    positions_to_names,
    unsaved_put_back,
)
from lightning_dist.checkpoint.safe_load import dcp_load_planner, dcp_reader, shard_error
from lightning_dist.checkpoint.state_paths import (
    MODEL_STATE,
    StatePath,
    get_path,
    model_state_paths,
    saved_state_paths,
    set_path,
    without_model_states,
)
from lightning_dist.checkpoint.unstepped_optimizer import left_unstepped, without_per_parameter_state
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.compat import gather_full_state
from lightning_dist.compat.torchao import plain_state

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass(frozen=True)
class StageLayout:
    """Where pipeline stages live: each rank holds only its stages' parameters, under their original names.

    Attributes:
        group: The pipeline group of this rank (one rank per stage, all with the same data/tensor-parallel index).
        leader: The global rank that gathers its stage's full state (the stage's first rank).
    """

    group: dist.ProcessGroup
    leader: int


def model_state(model: Module, full: bool, stages: StageLayout | None = None) -> dict[str, Any]:
    """Sharded (DTensor) model state, or the full state on CPU on rank 0 (empty elsewhere): with pipeline
    ``stages``, gathered from every stage. Plain tensors only: torchao's FP8 weight wrappers are removed (see
    :func:`~lightning_dist.compat.torchao.plain_state`), sharing storage with the weights. Collective."""
    if not full:
        return plain_state(get_model_state_dict(model))
    if stages is None:
        return plain_state(get_model_state_dict(model, options=_FULL))
    return _merge_stages(gather_full_state(plain_state(get_model_state_dict(model)), stages.leader), stages)


def optimizer_state(
    model: Module, optimizer: Optimizer, full: bool, stages: StageLayout | None = None
) -> dict[str, Any]:
    """Name-keyed sharded optimizer state, or on rank 0 the full state keyed by position as ``Optimizer.state_dict``
    does (so a one-device run can resume from it). With pipeline ``stages`` the full state stays keyed by name
    (positions of one stage's optimizer mean nothing to another's): lightning_dist loads either. Collective."""
    with left_unstepped(optimizer) as unstepped:  # saved before its first step: param groups only
        state = _optimizer_state(model, optimizer, full, stages)
    return without_per_parameter_state(state) if unstepped else state


def _optimizer_state(model: Module, optimizer: Optimizer, full: bool, stages: StageLayout | None) -> dict[str, Any]:
    # A pipeline stage with nothing to optimize has no optimizer state (torch refuses to make an empty one).
    held = holds_parameters(optimizer)
    if not full:  # keyed per parameter under a pipeline: one shared `param_groups.N.params` list would keep one stage's
        flat = _optimizer_options(flat=stages is not None)
        return plain_state(get_optimizer_state_dict(model, optimizer, options=flat)) if held else {}
    if stages is None:
        state = plain_state(get_optimizer_state_dict(model, optimizer, options=_FULL))
        return names_to_positions(state) if state else state
    local = plain_state(get_optimizer_state_dict(model, optimizer)) if held else {}
    return _merge_stages(gather_full_state(local, stages.leader), stages)


def _merge_stages(local: dict[str, Any], stages: StageLayout) -> dict[str, Any]:
    """Rank 0 receives every stage leader's state (each holds different keys) and merges them; others get ``{}``."""
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, parts, dst=0)  # over every rank: non-leaders send an empty dict
    if parts is None:
        return {}
    merged: dict[str, Any] = {}
    for part in parts:
        _merge_into(merged, part or {})
    return merged


def _merge_into(merged: dict[str, Any], part: dict[str, Any]) -> None:
    """Model states are flat; optimizer states hold ``state`` (by name) and ``param_groups`` (parameter names
    concatenated group by group, each once: ranks holding different experts share the dense parameters)."""
    for key, value in part.items():
        if key == "param_groups" and key in merged:
            for group, more in zip(merged[key], value):
                group["params"] = [*group["params"], *(n for n in more["params"] if n not in group["params"])]
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key].update(value)
        else:
            merged.setdefault(key, value)


def load_checkpoint_into(
    path: str | Path,
    model: Module,
    optimizers: Sequence[Optimizer],
    strict: bool,
    stages: StageLayout | None = None,
    weights_only: bool = True,
    targets: Callable[[list[StatePath]], dict[StatePath, Module]] | None = None,
) -> dict[str, Any]:
    """Load a validated checkpoint of either format into ``model`` (and ``optimizers``, if any), saved with any number
    of ranks; returns everything else it holds (Lightning's loops, callbacks, our provenance). With pipeline
    ``stages``, each rank loads its stages' keys and a strict load checks the keys of all stages together. With
    ``weights_only`` nothing but tensors and plain data is unpickled. ``targets``, given the paths of the model
    states the checkpoint holds (:mod:`~lightning_dist.checkpoint.state_paths`), says which module loads which
    (weight averaging's copies); by default ``model`` loads ``state_dict``. Collective (the ranks share the checksum
    verification)."""
    path = validate_checkpoint(path, weights_only)  # structure, sizes and the small files' checksums
    choose = targets or (lambda _: {MODEL_STATE: model})
    if is_sharded_checkpoint(path):
        meta = read_metadata(path, weights_only)  # before any shard is read: a refused meta.pt loads nothing
        chosen = choose(saved_state_paths(meta.get(PROVENANCE_KEY, {})))
        # the shards' checksums while DCP reads them (one pass over the disk); a damaged one is refused on every
        # rank before the step that would use what was loaded
        with checksums_verified_while_read(path, weights_only):
            load_sharded(path, model, optimizers, strict, stages, weights_only, chosen)
        return meta
    verify_checksums(path, weights_only)  # before torch.load reads the bytes
    full = read_checkpoint_file(path, weights_only)  # read once, used twice
    load_full(full, model, optimizers, strict, repr(str(path)), stages, choose(model_state_paths(full)))
    return without_model_states(full)


def load_sharded(
    path: Path,
    model: Module,
    optimizers: Sequence[Optimizer],
    strict: bool,
    stages: StageLayout | None = None,
    weights_only: bool = True,
    targets: dict[StatePath, Module] | None = None,
) -> None:
    """Load a DCP checkpoint folder into ``model`` and ``optimizers`` (any saved world size or mesh); ``targets``
    maps the model states to load to their modules (default: ``state_dict`` into ``model``). Collective."""
    targets = targets or {MODEL_STATE: model}
    index = dcp_reader(path, weights_only).read_metadata().state_dict_metadata
    if targets.get(MODEL_STATE) is model:  # saved by a Fabric loop for a LightningModule holding the model, or back
        model = aligned_module(model, _checkpoint_shapes(index, ".".join(MODEL_STATE) + "."))
        targets = {**targets, MODEL_STATE: model}
    # DCP loads into these tensors in place; unwrapped from torchao's FP8 wrappers, they share the weights' storage.
    state: dict[str, Any] = {}
    for state_path, module in targets.items():
        set_path(state, state_path, plain_state(get_model_state_dict(module)))
    flat = [_saved_flat(index, idx) for idx in range(len(optimizers))]
    requests: list[dict[str, Any]] = []
    stepped: list[bool] = []
    for idx, optimizer in enumerate(optimizers):
        options = _optimizer_options(flat[idx])
        with empty_groups_set_aside(optimizer):
            held = holds_parameters(optimizer)
            with left_unstepped(optimizer):  # the load below sets the state the checkpoint holds
                requested = plain_state(get_optimizer_state_dict(model, optimizer, options=options)) if held else {}
        prefix = f"optimizer_{idx}."
        requests.append(requested)
        stepped.append(any(key.startswith(f"{prefix}state.") for key in index))  # else saved before its first step
        asked = requested if stepped[-1] else without_per_parameter_state(requested)
        state[prefix[:-1]] = only_saved_group_options(asked, index, prefix)
    for state_path in targets:
        shapes = _tensor_shapes(get_path(state, state_path))
        saved = _checkpoint_shapes(index, ".".join(state_path) + ".")
        report = compare_shapes(shapes, saved, _keys_of_all_stages(shapes, stages))
        check_fit(report, strict, _naming(repr(str(path)), state_path))
    _require_optimizer_states(index, path, len(optimizers))
    try:
        dcp.load(
            state,
            storage_reader=dcp_reader(path, weights_only),
            planner=dcp_load_planner(weights_only, allow_partial_load=not strict),
        )
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise shard_error(err, f"Could not load the shards of {str(path)!r}") from err
    for state_path, module in targets.items():
        set_model_state_dict(module, get_path(state, state_path), options=StateDictOptions(strict=strict))
    for idx, optimizer in enumerate(optimizers):
        optimizer_state = state[f"optimizer_{idx}"]
        if stages is not None and not flat[idx]:  # saved without stages: its param groups name every parameter
            local = {name for group in parameter_names(model, optimizer) for name in group}
            optimizer_state = only_names(optimizer_state, local)
        unsaved: set[str] = set()
        if flat[idx]:  # what the checkpoint lacks (no moments, lr_find's initial_lr): torch reads every entry
            optimizer_state, unsaved = unsaved_put_back(requests[idx], optimizer_state)
        _set_optimizer_state(model, optimizer, optimizer_state, _optimizer_options(flat[idx]), stages)
        for group in optimizer.param_groups:  # the groups as saved, as `Optimizer.load_state_dict` leaves them
            for option in unsaved:
                group.pop(option, None)
        if not stepped[idx]:
            optimizer.state.clear()


def _set_optimizer_state(
    model: Module, optimizer: Optimizer, state: dict[str, Any], options: StateDictOptions, stages: StageLayout | None
) -> None:
    """``set_optimizer_state_dict``, with a pipeline stage's empty param groups set aside and given the options of
    their group on the stages that hold its parameters (see :mod:`.empty_param_groups`)."""
    with empty_groups_set_aside(optimizer):
        if holds_parameters(optimizer):
            set_optimizer_state_dict(model, optimizer, state, options=options)
    if not any(key == "state" and value or key.startswith("state.") for key, value in state.items()):
        optimizer.state.clear()  # saved before its first step: unstepped, as `Optimizer.load_state_dict` leaves it
    if stages is not None:
        share_group_options(optimizer, stages.group)


def _naming(where: str, state_path: StatePath) -> str:
    """How a fit error names the checkpoint (``where``) and the model state, when it is not ``state_dict``."""
    return where if state_path == MODEL_STATE else f"{where} ({'/'.join(state_path)})"


def _optimizer_options(flat: bool) -> StateDictOptions:
    """Optimizer states keyed per parameter (``param_groups.<name>.lr``: what each pipeline stage can save and load
    on its own) or as ``Optimizer.state_dict`` groups them (one ``params`` list per group: Lightning's format)."""
    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _saved_flat(index: dict[str, Any], idx: int) -> bool:
    """Whether optimizer ``idx`` of a DCP checkpoint (its ``index``) was saved keyed per parameter (see
    :func:`_optimizer_options`)."""
    prefix = f"optimizer_{idx}.param_groups."
    return any(key.startswith(prefix) for key in index) and f"{prefix}0.params" not in index


def load_full(
    checkpoint: dict[str, Any],
    model: Module,
    optimizers: Sequence[Optimizer],
    strict: bool,
    where: str,
    stages: StageLayout | None = None,
    targets: dict[StatePath, Module] | None = None,
) -> None:
    """Load a one-file checkpoint dict (full tensors; present on every rank) into a possibly sharded model;
    ``targets`` maps the model states to load to their modules (default: ``state_dict`` into ``model``)."""
    # Outside a process group there is nothing to distribute: the full state is the local state.
    options = StateDictOptions(full_state_dict=dist.is_initialized(), strict=strict)
    targets = targets or {MODEL_STATE: model}
    if targets.get(MODEL_STATE) is model and isinstance(checkpoint.get(MODEL_STATE[0]), dict):
        model = aligned_module(model, checkpoint[MODEL_STATE[0]])  # see load_sharded
        targets = {**targets, MODEL_STATE: model}
    for state_path, module in targets.items():
        full = get_path(checkpoint, state_path)
        shapes = _tensor_shapes(get_model_state_dict(module))
        all_keys = _keys_of_all_stages(shapes, stages)
        report: FitReport = compare_shapes(shapes, _tensor_shapes(full, keep_all=True), all_keys)
        if stages is not None:  # each rank sets its own stages' keys only
            full = {key: value for key, value in full.items() if key in shapes}
        check_fit(report, strict, _naming(where, state_path))
        set_model_state_dict(module, full, options=options)
    states = checkpoint.get("optimizer_states", [])
    if optimizers and len(states) < len(optimizers):
        raise CheckpointError(
            f"The checkpoint {where} holds {len(states)} optimizer state(s) but the model configures"
            f" {len(optimizers)} optimizer(s); it was saved without them (weights only?). Load it for evaluation,"
            " or start a new fit from its weights without ckpt_path."
        )
    for optimizer, state in zip(optimizers, states):
        if not is_name_keyed(state):
            try:
                state = positions_to_names(state, parameter_names(model, optimizer))
            except ValueError as err:
                raise CheckpointError(f"The optimizer state in {where} does not fit the optimizer: {err}") from err
        if stages is not None:
            state = only_names(state, {name for group in parameter_names(model, optimizer) for name in group})
        state = only_known_group_options(state, optimizer.param_groups)
        _set_optimizer_state(model, optimizer, state, options, stages)


def parameter_names(model: Module, optimizer: Optimizer) -> list[list[str]]:
    """The names of the optimizer's parameters, per param group, in order."""
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError as err:
        raise CheckpointError("The optimizer holds a parameter that is not part of the model.") from err


def _keys_of_all_stages(shapes: dict[str, Size | None], stages: StageLayout | None) -> set[str] | None:
    """The model keys of every pipeline stage together (``None`` without stages: this rank's keys are all)."""
    if stages is None:
        return None
    per_stage: list[Any] = [None] * dist.get_world_size(stages.group)
    dist.all_gather_object(per_stage, sorted(shapes), group=stages.group)
    return {key for keys in per_stage for key in keys}


def _tensor_shapes(state: dict[str, Any], keep_all: bool = False) -> dict[str, Size | None]:
    """Shapes of the tensors in a state dict; other entries (extra state) map to None, or are left out."""
    shapes: dict[str, Size | None] = {}
    for key, value in state.items():
        if torch.is_tensor(value):
            shapes[key] = Size(value.shape)
        elif keep_all:
            shapes[key] = None
    return shapes


def _checkpoint_shapes(index: dict[str, Any], prefix: str) -> dict[str, Size | None]:
    return {
        key[len(prefix) :]: Size(m.size) if isinstance(m, TensorStorageMetadata) else None
        for key, m in index.items()
        if key.startswith(prefix)
    }


def _require_optimizer_states(index: dict[str, Any], path: Path, count: int) -> None:
    if count == 0:
        return
    saved = {key.split(".", 1)[0] for key in index if key.startswith("optimizer_")}
    if len(saved) < count:
        raise CheckpointError(
            f"The checkpoint {str(path)!r} holds {len(saved)} optimizer state(s) but the model configures {count}"
            " optimizer(s); it was saved without them (weights only?). Load it for evaluation, or start a new fit"
            " from its weights without ckpt_path."
        )
