"""Hybrid3D's mesh: the axis sizes from the size options, ``mesh_shape`` or the planner (``mesh="auto"``), and
the model's checks against it: a pipeline stage under ``pp × tp`` holds something the tensor-parallel plan shards,
and under ``pp × cp`` the positions and rotary tables belong to the pipelined module."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn import Module

from lightning_dist.parallel import pipeline as pp
from lightning_dist.parallel.mesh import AXIS_OPTIONS, MESH_AXES, MeshConfigError
from lightning_dist.parallel.tensor_parallel import TensorParallelPlan, TensorParallelPlanError
from lightning_dist.strategies.base import MeshSize

if TYPE_CHECKING:
    from lightning_dist.strategies.hybrid3d import Hybrid3DStrategy

# Names a mesh_shape may use for an axis (the mesh's own names, and "dp" for the sharded data-parallel axis).
AXIS_ALIASES = {**{axis: axis for axis in MESH_AXES}, "dp": "dp_shard"}


def sizes_from_options(
    sizes: dict[str, MeshSize | None], mesh_shape: list[list[int | str]] | None, mesh: str | None
) -> dict[str, MeshSize]:
    """The requested axis sizes from the size options or ``mesh_shape`` (refusing both, or a malformed shape)."""
    given = {axis: size for axis, size in sizes.items() if size not in (1, None)}
    if mesh_shape is not None or mesh == "auto":
        what = "mesh_shape" if mesh_shape is not None else "mesh='auto'"
        if given:
            options = ", ".join(f"{AXIS_OPTIONS[a][0]}={s!r}" for a, s in given.items())
            raise MeshConfigError(f"Give the mesh either as {what} or as sizes, not both ({options} was also set).")
        if mesh_shape is not None and mesh == "auto":
            raise MeshConfigError("Give either mesh_shape or mesh='auto', not both.")
    if mesh_shape is None:
        if sizes["dp_shard"] is None:  # the default: what the others leave, unless another axis takes it
            sizes = {**sizes, "dp_shard": 1 if "auto" in given.values() else "auto"}
        return sizes
    if len(mesh_shape) != 2 or len(mesh_shape[0]) != len(mesh_shape[1]):
        raise MeshConfigError(
            f"mesh_shape={mesh_shape!r}: give two lists of equal length, the sizes and the axis names, e.g."
            " [[2, 2, 2], ['pp', 'dp_shard', 'tp']]."
        )
    shape: dict[str, MeshSize] = dict.fromkeys(MESH_AXES, 1)
    seen: set[str] = set()
    for size, name in zip(*mesh_shape):
        axis = AXIS_ALIASES.get(str(name))
        if axis is None:
            raise MeshConfigError(
                f"mesh_shape names the axis {name!r}; the axes are {list(MESH_AXES)} (or 'dp' for dp_shard)."
            )
        if axis in seen:
            raise MeshConfigError(f"mesh_shape names the axis {axis!r} twice.")
        seen.add(axis)
        shape[axis] = size  # type: ignore[assignment]
    return shape


def planner_sizes(strategy: Hybrid3DStrategy) -> dict[str, MeshSize]:
    """``mesh="auto"``: the planner's mesh for the strategy's model and processes (logged). For a mixture-of-experts
    model it chooses ``ep`` too, unless ``expert_parallel_size`` was given (then it plans with that)."""
    from lightning_dist.planning.recommend import recommend_mesh

    if strategy.lightning_module is None:
        raise MeshConfigError("mesh='auto' is chosen for a model: it is known once the Trainer runs fit.")
    memory = strategy.device_memory_gib
    if memory is None and strategy.root_device.type == "cuda":
        memory = torch.cuda.get_device_properties(strategy.root_device).total_memory / 2**30
    dims, reason = recommend_mesh(
        strategy.lightning_module,
        strategy.num_processes * strategy.num_nodes,
        strategy.num_nodes,
        seq_len=int(strategy.sequence_length),  # type: ignore[arg-type]
        micro_batch=strategy.micro_batch_size,
        global_batch=None,
        device_memory_gib=memory,
        precision=str(strategy.precision_plugin.precision),
        activation_checkpointing=strategy.activation_checkpointing,
        expert_parallel_size=None if strategy.expert_parallel_size == 1 else strategy.expert_parallel_size,
    )
    strategy.log_decision(f"mesh='auto': the planner chose {dims} ({reason})")
    return {**dims.as_dict(), **({"ep": dims.ep} if dims.ep > 1 else {})}


def refuse_stages_without_tensor_parallel(model: Module, plan: TensorParallelPlan, stages: pp.StagePlan) -> None:
    """A pipeline stage holding nothing the automatic plan shards would fail on its rank after launch."""
    prefix = pp.find_pipelined_module(model)
    for index, units in enumerate(stages.stages):
        names = [f"{prefix}.{u}" if prefix else u for u in units]
        if not any(k == n or k.startswith(f"{n}.") for k in plan.styles for n in names):
            why = "".join(f"; {n}: {r}" for n, r in plan.unplanned.items() if any(n.startswith(m) for m in names))
            raise TensorParallelPlanError(
                f"Pipeline stage {index} ({', '.join(units)}) holds no module that the automatic tensor-parallel plan"
                f" shards{why}. Pass an explicit `plan=`, or drop tensor parallelism (tensor_parallel_size=1) or the"
                " pipeline for this model."
            )


def check_pipelined_context_parallel(strategy: Hybrid3DStrategy, model: Module) -> str | None:
    """Under ``pp × cp`` the positions join the pipelined call's arguments, so they must be its own (a causal LM's
    labels are checked per call, in ``pipeline_inputs``); litgpt's rotary tables must be inside the pipelined module.
    Returns the tables' module name within each stage (``None``: no such tables, or not ``pp × cp``)."""
    if strategy.parallel_dims.cp == 1:
        return None
    pipelined, positions = strategy.pipelined_module, strategy.positions_argument
    if strategy.rope_tables is not None:  # litgpt: each stage slices its own copy of the tables
        where = next(n for n, m in model.named_modules() if m is pipelined)
        name, tables = strategy.rope_tables
        if not (where == "" or name == where or name.startswith(f"{where}.")):
            raise ValueError(
                f"hybrid3d: under pipeline × context parallelism the module whose rotary tables"
                f" ({'/'.join(tables)}) are sliced by the sequence length ({name!r}) must be the pipelined module"
                f" ({where!r}) or inside it. Use context parallelism with dp or tp, or pipeline without cp."
            )
        in_parts = name[len(where) :].lstrip(".") if where else name
    else:
        in_parts = None
    if positions is not None and model.get_submodule(positions[0]) is not pipelined:
        raise ValueError(
            f"hybrid3d: under pipeline × context parallelism the module that takes the positions"
            f" ({positions[0]!r}.{positions[1]}) must be the pipelined module ({type(pipelined).__name__})."
            " Give the pipelined module's forward a positions argument."
        )
    return in_parts
