"""FSDP2Strategy: fully sharded data parallelism (``fully_shard``) applied by the strategy, not the user."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
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
from lightning_dist.parallel.gradient_sync import (
    AccumulationSync,
    check_accumulation_sync,
    check_accumulation_sync_mesh,
)
from lightning_dist.parallel.mesh import MeshConfigError, ParallelDims
from lightning_dist.parallel.module_selection import check_unit_choice, select_modules
from lightning_dist.parallel.parallelize import ParallelizeConfig, ParallelizeRecord, parallelize
from lightning_dist.parallel.validation import check_bool, is_int
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize


class FSDP2Strategy(MeshParallelStrategy):
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
        reshard_after_forward: Overrides what ``sharding`` implies: ``True``, ``False``, or an int ``k`` that keeps a
            1/k slice after forward so backward gathers stay within groups of k ranks.
        wrap_modules: Module classes to shard as units instead of the detected blocks: classes in Python,
            class-path strings (``"my_pkg.model.Block"``) or bare class names in YAML.
        wrap_regex: A regex over qualified module names (``"layers\\.\\d+"``) selecting the units, alone or in
            addition to ``wrap_modules``.
        activation_checkpointing: Recompute the units' activations in backward (same unit selection).
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory.
        accumulation_sync: With ``accumulate_grad_batches=k``: ``"every"`` reduces gradients after each micro-batch
            (sharded gradient memory, k reduce-scatters per step); ``"last"`` only after the last (1/k of the bytes,
            full unsharded gradients held in between, as in DDP); ``"replicas_last"`` (``"hybrid"`` only)
            reduce-scatters every micro-batch but all-reduces across replica groups only after the last.
    """

    log_name = "fsdp2"

    def __init__(
        self,
        sharding: ShardingMode = "full",
        data_parallel_shard_size: MeshSize = "auto",
        data_parallel_replicate_size: MeshSize = "auto",
        reshard_after_forward: bool | int | None = None,
        wrap_modules: list[type[Module] | str] | set[type[Module]] | None = None,
        wrap_regex: str | None = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        accumulation_sync: AccumulationSync = "every",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if sharding not in SHARDING_MODES:
            raise ValueError(f"sharding={sharding!r} is not one of {list(SHARDING_MODES)}.")
        if is_int(reshard_after_forward) and reshard_after_forward < 2:
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward}: an int must be a group size of at least 2."
            )
        if cpu_offload and sharding == "no_shard":
            raise ValueError("cpu_offload needs sharded parameters; it cannot be combined with sharding='no_shard'.")
        self.sharding = sharding
        self.data_parallel_shard_size = data_parallel_shard_size
        self.data_parallel_replicate_size = data_parallel_replicate_size
        self.reshard_after_forward = reshard_after_forward
        self.wrap_modules, self.wrap_regex = check_unit_choice(wrap_modules, wrap_regex)
        self.activation_checkpointing = check_bool("activation_checkpointing", activation_checkpointing)
        self.cpu_offload = check_bool("cpu_offload", cpu_offload)
        self.accumulation_sync = check_accumulation_sync(accumulation_sync)

    @override
    def mesh_sizes(self) -> dict[str, MeshSize]:
        if self.sharding == "no_shard":
            return {"dp_replicate": "auto", "dp_shard": 1}
        replicate = self.data_parallel_replicate_size
        if replicate == "auto":  # hybrid: one replica group per node; otherwise no replication
            replicate = self.num_nodes if self.sharding == "hybrid" else 1
        return {"dp_replicate": replicate, "dp_shard": self.data_parallel_shard_size}

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
        check_accumulation_sync_mesh(self.accumulation_sync, dims)
        raf = self.reshard_after_forward
        if is_int(raf) and (dims.fsdp % raf or raf >= dims.fsdp):
            raise MeshConfigError(
                f"reshard_after_forward={raf} must be a divisor of the sharding group size {dims.fsdp} smaller than"
                " it (the size of the groups backward all-gathers stay in)."
            )

    @property
    @override
    def accumulation_sync_mode(self) -> AccumulationSync:
        return self.accumulation_sync

    @property
    @override
    def offloads_parameters(self) -> bool:
        return self.cpu_offload

    @override
    def check_model(self, model: Module) -> None:
        if not is_fully_sharded(model):
            units = select_modules(model, self.wrap_modules, self.wrap_regex, what="shard")
            shared_submodules(model, [m for _, m in [*units, *self.extra_shard_units(model, units)]])

    @property
    def fsdp_config(self) -> FSDPConfig:
        raf = self.reshard_after_forward
        if raf is None:
            raf = self.sharding in ("full", "hybrid")
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
        root_name = type(model).__name__  # before fully_shard renames the class
        record = parallelize(model, self.mesh, config)
        if record.checkpointed:
            self.log_decision(f"activation checkpointing on {record.checkpointed}")
        if record.compiled:
            self.log_decision(record.compiled)
        dims, fsdp = self.parallel_dims, config.fsdp
        assert fsdp is not None
        where = f"dp_shard={dims.dp_shard}" + (f" × cp={dims.cp}" if dims.cp > 1 else "")
        where += f" × dp_replicate={dims.dp_replicate}" if dims.dp_replicate > 1 else ""
        self.log_decision(
            f"sharding={self.sharding!r}: sharded {record.units}"
            + (f" + {', '.join(name for name, _ in config.extra_units)}" if config.extra_units else "")
            + (f" + shared {', '.join(record.shared)} as units of their own" if record.shared else "")
            + (f" + [{', '.join(record.outside)}] as one unit" if record.outside else "")
            + f" + root {root_name} over {where},"
            f" reshard_after_forward={fsdp.reshard_after_forward}, precision={self.precision_plugin.precision}"
            + (", cpu_offload" if self.cpu_offload else "")
        )
        self.log_parallelized(record)
        return model

    def parallelize_config(self, model: Module) -> ParallelizeConfig:
        """This strategy's options as one :class:`~lightning_dist.parallel.parallelize.ParallelizeConfig`."""
        units = select_modules(model, self.wrap_modules, self.wrap_regex, what="shard")
        return ParallelizeConfig(
            units=units,
            activation_checkpointing=self.activation_checkpointing,
            compile=self.compile_options,
            fsdp=self.fsdp_config,
            root_mp_policy=self.precision_plugin.root_mp_policy,
            extra_units=self.extra_shard_units(model, units),
        )

    def log_parallelized(self, record: ParallelizeRecord) -> None:
        """Log what a subclass adds to the record (ZeRO++ comms); nothing here."""

    def extra_shard_units(self, model: Module, units: list[tuple[str, Module]]) -> list[tuple[str, Module]]:
        """Modules to shard as units of their own besides the blocks (not activation-checkpointed); none here."""
        return []
