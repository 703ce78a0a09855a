"""One function that applies every parallelism to a model: ``parallelize(model, mesh, config) -> record``.

The order is torchtitan's, and each step runs only where its option or mesh axis is on:

1. tensor parallelism (a resolved plan over the ``tp`` axis), then expert parallelism (experts split over ``ep``;
   FSDP2 shards stacked experts over the ranks ep leaves, ``ep_fsdp``, as units of their own);
2. activation checkpointing of the units;
3. ``torch.compile`` of each unit, in place (:meth:`torch.nn.Module.compile`: no ``_orig_mod.`` in any name, so
   checkpoints are interchangeable between compiled and uncompiled runs);
4. FSDP2 (or HSDP) over the data-parallel mesh: shared modules, then the units, then the modules outside them as
   one unit, then the root; with custom collectives (ZeRO++) installed on every unit.

Compile granularity: each repeated block, and nothing outside the blocks. Compiling a block before ``fully_shard``
keeps FSDP2's all-gather/reduce-scatter hooks at the block's edges, where they run eagerly (``skip_fsdp_hooks``), so
the block's body is one graph and the N blocks of a model share one compiled graph (their code is the same; the
parameters are graph inputs), which keeps compile time to that of one block. The code outside the blocks was left
eager on purpose: the embedding, the final norm and the head are single operations that a compiler cannot fuse
with anything (a lookup, one norm, one matmul), and the loss, the part that does pay (log-softmax over the
vocabulary), is not a module of ours: it is in the user's ``training_step`` or inside a Hugging Face model's root
``forward`` that also calls every block, so compiling it means compiling the root, which traces through every FSDP
unit and breaks its graph at each one (+5% on one H100 for a user-compiled model under ``fsdp2``, against +20% for
per-block compilation of a raw FSDP2 loop). The full-graph route (FSDP2 hooks traced with compiled autograd) is
experimental in torch and cannot be tested on CPU. Users who want the loss compiled too can ``torch.compile`` their
loss function: a function, not a module, so no name changes.

Measured roughly on CPU (2 shared cores under a load average of 10-18; one process, fp32, the example GPT with
d_model 128, 4 blocks, seq 128, batch 8; medians of 20 interleaved steps per variant, against eager): per-block
1.11× at vocabulary 512 and 1.01-1.18× at vocabulary 8192; per-block plus compiled final norm and head modules
0.91× (no gain: a lone matmul has nothing to fuse with); per-block plus a compiled cross-entropy 1.13-1.14×; the
whole step compiled 1.12-1.16×. Repeats differed by up to 15%, so on CPU only "norm and head alone do not pay" is
clear; ``python -m benchmarks.run --gpu`` compares per-block ``fsdp2`` with a whole-model compile on a GPU.

Strategies are presets: they map their options onto one :class:`ParallelizeConfig` and log from the returned
:class:`ParallelizeRecord`. Pure PyTorch, no Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from lightning_dist.parallel.activation_checkpointing import apply_activation_checkpointing, turn_off_generation_cache
from lightning_dist.parallel.compile import compile_modules, describe_compile_options
from lightning_dist.parallel.expert_parallel import (
    ExpertParallelRecord,
    apply_expert_parallel,
    expert_parameters,
    mark_held_experts,
)
from lightning_dist.parallel.expert_parallel.sharding import (
    expert_shard_placement,
    held_expert_modules,
    stacked_experts_modules,
)
from lightning_dist.parallel.fsdp import FSDPConfig, MeshUnit, apply_fsdp, fsdp_modules, shared_submodules
from lightning_dist.parallel.mesh import ParallelMesh
from lightning_dist.parallel.module_selection import summarize
from lightning_dist.parallel.tensor_parallel.apply import apply_tensor_parallel
from lightning_dist.parallel.tensor_parallel.plan import TensorParallelPlan
from lightning_dist.parallel.zeropp import install_comms

Unit = tuple[str, nn.Module]


@dataclass
class ParallelizeConfig:
    """What :func:`parallelize` applies.

    Attributes:
        units: The repeated blocks (name, module): activation-checkpointed and sharded as FSDP units.
        tp_plan: A resolved tensor-parallel plan, applied over the ``tp`` axis; ``None``: no tensor parallelism.
        activation_checkpointing: Recompute activations in backward: ``True`` the units', an int k every k-th unit's,
            ``"selective"`` the units' except their matmul and attention outputs, a tuple of classes (or names)
            the modules of those classes' (:mod:`.activation_checkpointing`). A Hugging Face model's key/value cache
            is then turned off for good (``use_cache=False``: a recomputed block must save what its forward saved),
            unless ``keep_generation_cache``.
        keep_generation_cache: Leave ``use_cache`` as it is under activation checkpointing: the caller turns the
            cache off around each training step itself (the strategies do, so that evaluation keeps the setting).
        compile: ``torch.compile`` keyword arguments for each unit (``{}``: the defaults); ``None``: no compilation.
        fsdp: How to shard; ``None``: no FSDP2.
        root_mp_policy: The root module's mixed-precision policy (default: ``fsdp.mp_policy``).
        extra_units: Modules sharded as units of their own besides the blocks, not checkpointed (ZeRO++ hpZ).
        all_gather: A custom FSDP2 all-gather for every unit (ZeRO++ qwZ).
        reduce_scatter: A custom FSDP2 reduce-scatter for every unit (ZeRO++ qgZ).
        expert_parallel: Split the mixture-of-experts layers' experts over ``mesh["ep"]`` (``dims.ep`` > 1).
        expert_modules: A pattern naming the experts modules, when they are not found from their structure.
        expert_dispatch_chunks: Token chunks per MoE layer whose all-to-alls overlap the experts' work (1: none).
    """

    units: list[Unit] = field(default_factory=list)
    tp_plan: TensorParallelPlan | None = None
    activation_checkpointing: bool | int | str | tuple[type[nn.Module] | str, ...] = False
    keep_generation_cache: bool = False
    compile: dict[str, Any] | None = None
    fsdp: FSDPConfig | None = None
    root_mp_policy: MixedPrecisionPolicy | None = None
    extra_units: list[Unit] = field(default_factory=list)
    all_gather: Any = None
    reduce_scatter: Any = None
    expert_parallel: bool = False
    expert_modules: str | None = None
    expert_dispatch_chunks: int = 1


@dataclass
class ParallelizeRecord:
    """What :func:`parallelize` did, for log lines and tests.

    Attributes:
        tp_changes: Head-count attributes set to the per-rank count (``"blocks.0.attn.n_head": "4 → 2"``).
        checkpointed: Summary of the activation-checkpointed units (``"4 × Block"``), or ``None``.
        compiled: A log line saying which units were compiled and how, or ``None`` without ``compile``.
        units: Summary of the FSDP units (``"4 × Block"``), or ``None`` without FSDP.
        shared: Names of modules shared by several units, sharded as units of their own.
        outside: Names of the modules outside the units, sharded together as one unit.
        fsdp_modules: Modules ``fully_shard`` was applied to (the root included).
        comms_units: FSDP modules that got the custom collectives.
        experts: What expert parallelism did, or ``None``.
    """

    tp_changes: dict[str, str] = field(default_factory=dict)
    checkpointed: str | None = None
    compiled: str | None = None
    units: str | None = None
    shared: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    fsdp_modules: int = 0
    comms_units: int = 0
    experts: ExpertParallelRecord | None = None


def parallelize(model: nn.Module, mesh: ParallelMesh, config: ParallelizeConfig) -> ParallelizeRecord:
    """Apply ``config`` to ``model`` in place, on every rank (collective where sharding communicates)."""
    record = ParallelizeRecord()
    names = {id(m): n for n, m in model.named_modules()}  # before fully_shard renames the classes
    if config.tp_plan is not None:
        record.tp_changes = apply_tensor_parallel(model, mesh["tp"], config.tp_plan)
    shard_experts = config.expert_parallel and config.fsdp is not None and mesh.dims.fsdp > mesh.dims.ep
    if config.expert_parallel:
        dims = mesh.dims
        replicas = mesh["ep_replicas"] if dims.dp_replicate * dims.fsdp > dims.ep else None
        record.experts = apply_expert_parallel(
            model, mesh["ep"], dims.dp_replicate * dims.fsdp, replicas, mesh["loss"], config.expert_modules,
            fsdp_shards_experts=shard_experts, dispatch_chunks=config.expert_dispatch_chunks,
        )  # fmt: skip
    if config.activation_checkpointing:
        spec = config.activation_checkpointing
        chosen = apply_activation_checkpointing(model, config.units, spec)
        record.checkpointed = summarize(chosen) + _checkpointing_kind(spec, len(config.units))
        if not config.keep_generation_cache and (uncached := turn_off_generation_cache(model)):
            record.checkpointed += f" (config.use_cache turned off on {', '.join(uncached)}, as transformers does)"
    if config.compile is not None:
        record.compiled = _compile_units(config)
    if config.fsdp is None:
        return record
    record.units = summarize(config.units)
    shard = [m for _, m in [*config.units, *config.extra_units]]
    record.shared = [names[id(m)] for m in shared_submodules(model, shard)]
    experts: list[MeshUnit] = []
    if shard_experts:
        assert mesh.experts_data_parallel is not None and record.experts is not None
        placement = expert_shard_placement(mesh["ep_fsdp"].size())
        experts = [MeshUnit(m, mesh.experts_data_parallel, placement) for m in stacked_experts_modules(model)]
        experts += [MeshUnit(m, mesh.experts_data_parallel) for m in held_expert_modules(model)]
        record.experts.sharded_over = mesh["ep_fsdp"].size() if experts else 1
    held = {p for unit in experts for p in unit.module.parameters()}
    ignored = {p for p in expert_parameters(model) if p not in held} if record.experts is not None else None
    outside = apply_fsdp(
        model,
        mesh.data_parallel,
        shard,
        config.fsdp,
        root_mp_policy=config.root_mp_policy,
        ignored_params=ignored or None,
        mesh_units=experts,
    )
    record.outside = [names[id(m)] for m in outside]
    mark_held_experts(model)  # FSDP2 made new parameter objects for the held ModuleList experts, without marks
    sharded = fsdp_modules(model)
    record.fsdp_modules = len(sharded)
    if config.all_gather is not None or config.reduce_scatter is not None:
        # the dense units' collectives (ZeRO++'s quantized ones are sized for the data-parallel mesh, not ep_fsdp)
        dense = [m for m in sharded if all(m is not unit.module for unit in experts)]
        record.comms_units = install_comms(dense, config.all_gather, config.reduce_scatter)
    return record


def _compile_units(config: ParallelizeConfig) -> str:
    """Compile every unit in place (after tensor parallelism and activation checkpointing, before FSDP2)."""
    assert config.compile is not None
    how = describe_compile_options(config.compile)
    if not config.units:
        return f"compile: no repeated blocks found, nothing compiled ({how} not applied); the model runs eagerly"
    compile_modules((m for _, m in config.units), config.compile)
    before = "before FSDP2 shards them" if config.fsdp is not None else "in place"
    return (
        f"compiled {summarize(config.units)} with {how}, {before}; the embedding, final norm, head and loss"
        " outside the blocks run eagerly"
    )


def _checkpointing_kind(spec: Any, units: int) -> str:
    """What the activation checkpointing summary adds about ``spec`` (nothing for ``True`` or classes)."""
    if spec == "selective":
        return " (selective: their matmul and attention outputs kept, the rest recomputed)"
    if isinstance(spec, int) and not isinstance(spec, bool):
        suffix = "th" if 10 <= spec % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(spec % 10, "th")
        return f" (every {spec}{suffix} of {units} units)"
    return ""
