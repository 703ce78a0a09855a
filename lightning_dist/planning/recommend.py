"""One mesh for a model on ``world_size`` devices: the planner's best feasible mesh and why (``mesh: auto``).

:func:`plan_meshes` ranks every mesh (what ``lightning-dist plan --devices`` prints); :func:`recommend_mesh` returns
the first feasible one. Both read the model off a copy on the meta device, so the given model, real or meta, is
neither moved nor changed, and nothing is allocated. The answer depends only on the arguments and the model's
structure (no timing, no randomness, no device query), so every rank that calls it gets the same mesh.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from lightning_dist.compat.lightning_module import attached_trainer, is_lightning_default_forward
from lightning_dist.parallel.mesh import ParallelDims
from lightning_dist.planning.estimate import (
    COMPUTE_BYTES,
    GIB,
    OPTIMIZER_STATES,
    Estimate,
    Hardware,
    Workload,
    estimate,
)
from lightning_dist.planning.model_facts import ActivationFacts, ModelFacts, activation_facts, model_facts
from lightning_dist.planning.search import Candidate, plan, reason

_DTYPES = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}


class NoMeshFits(ValueError):
    """Raised by :func:`recommend_mesh` when every mesh is ruled out; the message lists each mesh and why."""


@dataclass(frozen=True)
class MeshPlan:
    """Every mesh of ``world_size`` ranks for one model and workload, best first (see :func:`.search.plan`)."""

    facts: ModelFacts
    workload: Workload
    hardware: Hardware
    world_size: int
    candidates: list[Candidate]

    def best(self) -> tuple[ParallelDims, str]:
        """The first feasible mesh and the one-line reason; :class:`NoMeshFits` listing every mesh when none is."""
        for c in self.candidates:
            if c.feasible:
                return c.mesh, reason(c, self.hardware)
        lines = "\n".join(f"  {c.mesh}: {'; '.join(c.problems)}" for c in self.candidates)
        raise NoMeshFits(
            f"No mesh of {self.world_size} devices fits this model and workload (seq {self.workload.seq_len},"
            f" micro-batch {self.workload.micro_batch}, global batch {self.workload.global_batch},"
            f" {self.workload.precision}, {_memory_label(self.hardware)} per device). Every mesh is ruled out:\n{lines}"
            "\nAdd devices, turn on activation checkpointing, or use a smaller micro-batch or a lower precision."
        )


def meta_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (``dtype``: floating ones cast).

    The copy is made with every parameter and buffer pre-mapped to an empty meta tensor of its (global) shape, so
    nothing is copied but the module objects; tied weights stay tied. ``model`` is left as it was.
    """
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    trainer = attached_trainer(model)  # a LightningModule's Trainer is not part of the model
    if trainer is not None:
        memo[id(trainer)] = None
    clone = copy.deepcopy(model, memo)
    return clone.to(dtype) if dtype is not None else clone


def plan_meshes(
    model: nn.Module,
    world_size: int,
    num_nodes: int = 1,
    *,
    seq_len: int,
    micro_batch: int,
    global_batch: int | None,
    device_memory_gib: float | None,
    precision: str,
    optimizer: str = "adamw",
    activation_checkpointing: bool = False,
    expert_parallel_size: int | str | None = None,
) -> MeshPlan:
    """Rank every mesh of ``world_size`` ranks (``num_nodes`` nodes of ``world_size / num_nodes``) for ``model``.

    Arguments as in :func:`recommend_mesh`.
    """
    if world_size < 1 or num_nodes < 1 or world_size % num_nodes:
        raise ValueError(f"world_size={world_size} must be a positive multiple of num_nodes={num_nodes}.")
    if precision not in COMPUTE_BYTES:
        raise ValueError(f"precision={precision!r} is not one of {sorted(COMPUTE_BYTES)}.")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZER_STATES)}.")
    if seq_len < 1 or micro_batch < 1 or (global_batch is not None and global_batch < 1):
        raise ValueError(f"seq_len={seq_len}, micro_batch={micro_batch}, global_batch={global_batch} must be >= 1.")
    if device_memory_gib is not None and not device_memory_gib > 0:
        raise ValueError(f"device_memory_gib={device_memory_gib} must be positive (or None: not checked).")
    meta = meta_copy(model, _DTYPES[COMPUTE_BYTES[precision]])
    meta.train()
    facts = model_facts(meta)
    workload = Workload(
        seq_len,
        micro_batch,
        global_batch if global_batch is not None else world_size * micro_batch,
        precision,
        optimizer,
        activation_checkpointing,
    )
    memory = math.inf if device_memory_gib is None else device_memory_gib * GIB
    hardware = Hardware(world_size // num_nodes, memory)

    forward = _forward_module(meta)

    def activations_at(cp: int) -> ActivationFacts:
        return activation_facts(forward, micro_batch, seq_len // cp)

    candidates = plan(facts, activations_at, workload, hardware, world_size, ep=expert_parallel_size)
    return MeshPlan(facts, workload, hardware, world_size, candidates)


def recommend_mesh(
    model: nn.Module,
    world_size: int,
    num_nodes: int = 1,
    *,
    seq_len: int,
    micro_batch: int,
    global_batch: int | None,
    device_memory_gib: float | None,
    precision: str,
    optimizer: str = "adamw",
    activation_checkpointing: bool = False,
    expert_parallel_size: int | str | None = None,
) -> tuple[ParallelDims, str]:
    """The planner's best feasible mesh for ``model`` on ``world_size`` ranks, and a one-line reason.

    Args:
        model: The model (an ``nn.Module`` or LightningModule whose forward takes token ids ``[batch, seq]``), on any
            device, meta included. It is not moved or changed: the planner works on a meta copy.
        world_size: Ranks in all; ``num_nodes`` nodes of ``world_size / num_nodes`` devices (tp stays in a node).
        seq_len: Tokens per sample (the global sequence, before context parallelism splits it).
        micro_batch: Samples per data-parallel rank per forward.
        global_batch: Samples per optimizer step over all ranks; ``None``: ``world_size × micro_batch`` (a mesh with
            fewer data-parallel ranks accumulates, or pipelines, the rest).
        device_memory_gib: Memory per device; 90% of it is usable. ``None``: memory is not checked (every mesh
            fits). Pass the same value on every rank.
        precision: A Trainer precision flag (``"bf16-mixed"``, ``"32-true"``, ...).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd_momentum"`` or ``"sgd"`` (states per parameter).
        activation_checkpointing: Whether each block's activations are recomputed in backward.
        expert_parallel_size: For a mixture-of-experts model: ``None`` lets the planner choose ``ep`` too (1 for a
            dense model), an int keeps that ``ep``, ``"auto"`` takes all of dp_shard × cp.

    Returns:
        The mesh (``ParallelDims``, ``ep`` included) and one line on why it was chosen.

    Raises:
        NoMeshFits: a ``ValueError`` listing every mesh and what rules it out, when none is feasible.
        ValueError: for arguments that make no sense (a world size that nodes do not divide, an unknown precision).
    """
    return plan_meshes(
        model,
        world_size,
        num_nodes,
        seq_len=seq_len,
        micro_batch=micro_batch,
        global_batch=global_batch,
        device_memory_gib=device_memory_gib,
        precision=precision,
        optimizer=optimizer,
        activation_checkpointing=activation_checkpointing,
        expert_parallel_size=expert_parallel_size,
    ).best()


def estimate_mesh(
    model: nn.Module,
    mesh: ParallelDims,
    num_nodes: int = 1,
    *,
    seq_len: int,
    micro_batch: int,
    global_batch: int,
    precision: str,
    optimizer: str = "adamw",
    activation_checkpointing: bool = False,
    schedule: str = "1f1b",
) -> Estimate:
    """The planner's per-rank memory and communication of ``model`` on one given ``mesh`` (a meta copy, as above)."""
    meta = meta_copy(model, _DTYPES[COMPUTE_BYTES[precision]])
    meta.train()
    workload = Workload(seq_len, micro_batch, global_batch, precision, optimizer, activation_checkpointing, schedule)
    hardware = Hardware(mesh.world_size // num_nodes, math.inf)
    activations = activation_facts(_forward_module(meta), micro_batch, seq_len // mesh.cp)
    return estimate(model_facts(meta), activations, mesh, workload, hardware)


def _forward_module(model: nn.Module) -> nn.Module:
    """What to call on token ids: the model, or for a module without a ``forward`` of its own (a LightningModule whose
    ``training_step`` calls ``self.model``) the child that holds every parameter."""
    if type(model).forward is not nn.Module.forward and not is_lightning_default_forward(model):
        return model
    total = sum(p.numel() for p in model.parameters())
    for child in model.children():
        if sum(p.numel() for p in child.parameters()) == total:
            return child
    return model


def _memory_label(hardware: Hardware) -> str:
    if math.isinf(hardware.memory_bytes):
        return "memory not checked"
    return f"{hardware.memory_bytes / GIB:g} GiB"
