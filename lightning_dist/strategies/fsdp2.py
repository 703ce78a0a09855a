"""FSDP2Strategy: fully sharded data parallelism (``fully_shard``) applied by the strategy, not the user."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.fsdp import FSDPModule
from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel.fsdp import (
    SHARDING_MODES,
    FSDPConfig,
    ShardingMode,
    apply_fsdp,
    is_fully_sharded,
    shared_submodules,
)
from lightning_dist.parallel.mesh import ParallelDims
from lightning_dist.parallel.parallelize import ParallelizeConfig, ParallelizeRecord, parallelize
from lightning_dist.parallel.validation import check_bool
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize
from lightning_dist.strategies.lightning_arguments import from_fsdp_strategy_arguments, speaks_fsdp_strategy
from lightning_dist.strategies.parallelisms.expert_parallel import ExpertParallelOption
from lightning_dist.strategies.parallelisms.fault_tolerance import FaultToleranceOption, FaultToleranceSpec


class FSDP2Strategy(FaultToleranceOption, ExpertParallelOption, MeshParallelStrategy):
    """Fully Sharded Data Parallel (FSDP2) for an unchanged LightningModule.

    The strategy finds the model's repeated blocks (the same-class children of its ``ModuleList``/``ModuleDict``),
    shards each one as a unit, then shards the root. No ``configure_model`` is needed; if the model's
    ``configure_model`` already applied ``fully_shard``, that sharding is kept as it is.

    Args:
        sharding: ``"full"`` (ZeRO-3: parameters re-gathered in backward), ``"grad_op"`` (ZeRO-2-like: parameters
            stay gathered from forward to backward), ``"no_shard"`` (replicated, DDP-like) or ``"hybrid"`` (HSDP:
            replicated across ``data_parallel_replicate_size`` groups, sharded inside each).
        data_parallel_shard_size: Ranks a parameter is sharded over. ``"auto"``: what the other sizes leave.
        data_parallel_replicate_size: Replica groups for ``"hybrid"``; ``"auto"`` means one per node.
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory.
        expert_parallel_size: Expert parallelism for mixture-of-experts models (transformers 5.x Mixtral, Qwen3-MoE...):
            each group of this many data-parallel ranks splits every MoE layer's experts (each rank keeps
            ``E / expert_parallel_size``) and sends tokens to them by all-to-all, instead of all-gathering every
            expert. It must divide the experts and ``data_parallel_shard_size``; ``"auto"``: all of
            ``data_parallel_shard_size`` (the ``expert_parallel`` strategy name); 1 (default): off. See
            docs/expert_parallel.md.
        expert_modules: For a model whose experts are not found from their structure: a pattern of the experts
            modules' qualified names (``*`` for any part: ``"model.layers.*.moe.expert_list"``), each a
            ``ModuleList`` of same-class experts or a module with 3-D ``gate_up_proj``/``down_proj`` parameters.
        log_expert_load: With expert parallelism, log every MoE layer's load each training step as
            ``expert_load/<experts module>``: max / mean tokens per expert over the whole batch (1.0: balanced;
            ``E / top_k``: routing collapsed onto the same experts).
        expert_dispatch_chunks: With expert parallelism, send each MoE layer's tokens in this many chunks: every
            chunk's all-to-all is in flight while the experts compute another chunk, forward and backward, so
            communication overlaps computation (transformers' stacked experts; 1, the default: one all-to-all each
            way). The results are the same; whether it pays depends on the interconnect and the experts' size.
        fault_tolerance: Train through the failure of whole replica groups with torchft (``pip install
            'lightning-dist[ft]'``): this job is one replica group, ``{"replica_group_id": i, "num_replica_groups":
            n, "min_replica_groups": m, "lighthouse": "http://host:29510"}`` (fields left out come from
            ``LIGHTNING_DIST_REPLICA_GROUP_ID``, ``LIGHTNING_DIST_NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE``;
            ``True``: all of them). Gradients are averaged over the live groups each step; a group that fails is
            dropped, and copies the live state when it comes back. See docs/fault_tolerance.md.
        **kwargs: The options every strategy takes (``reshard_after_forward``, which overrides what ``sharding``
            implies, ``wrap_modules``, ``wrap_regex``, ``activation_checkpointing``, ``accumulation_sync``,
            ``compile``...): see :class:`~lightning_dist.strategies.base.MeshParallelStrategy`.
    """

    log_name = "fsdp2"

    def __init__(
        self,
        sharding: ShardingMode = "full",
        data_parallel_shard_size: MeshSize = "auto",
        data_parallel_replicate_size: MeshSize = "auto",
        cpu_offload: bool = False,
        expert_parallel_size: MeshSize = 1,
        expert_modules: str | None = None,
        log_expert_load: bool = False,
        expert_dispatch_chunks: int = 1,
        fault_tolerance: FaultToleranceSpec = None,
        **kwargs: Any,
    ) -> None:
        if speaks_fsdp_strategy(cpu_offload, kwargs):  # a project's FSDPStrategy arguments, kept as they were
            given = {"sharding": sharding, "cpu_offload": cpu_offload, "data_parallel_shard_size":
                     data_parallel_shard_size, "data_parallel_replicate_size": data_parallel_replicate_size, **kwargs}
            kwargs, notes = from_fsdp_strategy_arguments(given)
            sharding, cpu_offload = kwargs.pop("sharding"), kwargs.pop("cpu_offload")
            data_parallel_shard_size = kwargs.pop("data_parallel_shard_size")
            data_parallel_replicate_size = kwargs.pop("data_parallel_replicate_size")
            for note in notes:
                rank_zero_info(f"fsdp2: {note}")
        super().__init__(**kwargs)
        if sharding not in SHARDING_MODES:
            raise ValueError(f"sharding={sharding!r} is not one of {list(SHARDING_MODES)}.")
        if cpu_offload and sharding == "no_shard":
            raise ValueError("cpu_offload needs sharded parameters; it cannot be combined with sharding='no_shard'.")
        self.sharding = sharding
        self.data_parallel_shard_size = data_parallel_shard_size
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.cpu_offload = check_bool("cpu_offload", cpu_offload)
        self.init_expert_parallel(expert_parallel_size, expert_modules, log_expert_load, expert_dispatch_chunks)
        self.init_fault_tolerance(fault_tolerance)

    @override
    def mesh_sizes(self) -> dict[str, MeshSize]:
        ep = self.expert_parallel_sizes()
        if self.sharding == "no_shard":
            return {"dp_replicate": "auto", "dp_shard": 1, **ep}
        replicate = self.data_parallel_replicate_size
        if replicate == "auto":  # hybrid: one replica group per node; otherwise no replication
            replicate = self.num_nodes if self.sharding == "hybrid" else 1
        return {"dp_replicate": replicate, "dp_shard": self.data_parallel_shard_size, **ep}

    @override
    def validate_mesh(self, dims: ParallelDims) -> None:
        if self.cpu_offload and self.parallel_devices and self.parallel_devices[0].type == "cpu":
            raise ValueError(
                "cpu_offload=True moves sharded state from the accelerator to CPU memory, but this run already uses"
                " the CPU accelerator. Drop cpu_offload (or the `_cpu_offload` strategy name) on CPU."
            )
        if self.sharding != "no_shard" and dims.fsdp == 1 and dims.world_size > 1:
            rank_zero_warn(
                f"sharding={self.sharding!r}, but data_parallel_replicate_size={dims.dp_replicate} leaves one rank per"
                " sharding group: every parameter is replicated, nothing is sharded. Lower"
                " data_parallel_replicate_size (it must divide the world size; shard size = world size / it), or use"
                " sharding='no_shard' if replication is what you want."
            )
        self.resolve_mesh_options(dims)

    def resolve_mesh_options(self, dims: ParallelDims) -> None:
        """Options whose value depends on the resolved mesh sizes, resolved with the mesh's checks (none here)."""

    @property
    @override
    def offloads_parameters(self) -> bool:
        return self.cpu_offload

    @override
    def check_model(self, model: Module) -> None:
        self.check_expert_parallel_model(model)
        if not is_fully_sharded(model):
            units = self.shard_units(model)
            shared_submodules(model, [m for _, m in [*units, *self.extra_shard_units(model, units)]])

    @property
    def fsdp_config(self) -> FSDPConfig:
        raf = self.fsdp_reshard_after_forward(default=self.sharding in ("full", "hybrid"))
        return FSDPConfig(
            reshard_after_forward=raf, mp_policy=self.precision_plugin.mp_policy, cpu_offload=self.cpu_offload
        )

    @override
    def parallelize(self, model: Module) -> Module:
        if is_fully_sharded(model):
            if not isinstance(model, FSDPModule):  # blocks only: the root's own parameters would never be reduced
                root_policy = self.precision_plugin.root_mp_policy
                apply_fsdp(model, self.mesh.data_parallel, (), self.fsdp_config, root_mp_policy=root_policy)
            self.log_decision(
                "the model's configure_model already applied fully_shard; keeping that sharding (its mixed-precision"
                " policy is the one configure_model chose)"
                + (
                    "; compile is not applied: call block.compile() in configure_model before fully_shard instead"
                    if self.compile_options is not None
                    else ""
                )
            )
            return model
        config = self.parallelize_config(model)
        root = type(model).__name__  # before fully_shard renames the class
        record = parallelize(model, self.mesh, config)
        self.log_layout(config, record, root, label=f"sharding={self.sharding!r}:", extras=self.comms_log(record))
        return model

    def parallelize_config(self, model: Module) -> ParallelizeConfig:
        """This strategy's options as one :class:`~lightning_dist.parallel.parallelize.ParallelizeConfig`."""
        units = self.shard_units(model)
        return ParallelizeConfig(
            units=units,
            activation_checkpointing=self.activation_checkpointing,
            keep_generation_cache=True,  # off in training steps only (StepProtocol.train_context)
            compile=self.compile_options,
            fsdp=self.fsdp_config,
            root_mp_policy=self.precision_plugin.root_mp_policy,
            extra_units=self.extra_shard_units(model, units),
            expert_parallel=self.parallel_dims.ep > 1,
            expert_modules=self.expert_modules,
            expert_dispatch_chunks=self.expert_dispatch_chunks,
        )

    def comms_log(self, record: ParallelizeRecord) -> list[str]:
        """Log lines of what a subclass adds to the sharding (ZeRO++'s collectives); none here."""
        return []

    def extra_shard_units(self, model: Module, units: list[tuple[str, Module]]) -> list[tuple[str, Module]]:
        """Modules to shard as units of their own besides the blocks (not activation-checkpointed); none here."""
        return []
