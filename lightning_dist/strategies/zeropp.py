"""ZeroPPStrategy: ZeRO++ (qwZ, hpZ, qgZ) on FSDP2, for an unchanged LightningModule."""

from __future__ import annotations

from typing import Any, Literal

import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel.fsdp import FSDPConfig
from lightning_dist.parallel.mesh import ParallelDims
from lightning_dist.parallel.parallelize import ParallelizeConfig, ParallelizeRecord
from lightning_dist.parallel.quantization import check_bits, check_block_size
from lightning_dist.parallel.validation import check_bool, check_positive_int, is_positive_int
from lightning_dist.parallel.zeropp import (
    NodeGroups,
    QuantizedAllGather,
    QuantizedReduceScatter,
    leftover_param_modules,
    new_node_groups,
)
from lightning_dist.parallel.zeropp_topology import HPZ_OFFLOAD, resolve_hpz
from lightning_dist.plugins.precision import FSDP2Precision, to_fsdp2_precision
from lightning_dist.plugins.zeropp_precision import ZeroPPPrecision
from lightning_dist.strategies.fsdp2 import FSDP2Strategy
from lightning_dist.strategies.lightning_arguments import from_deepspeed_config

# The FSDP2 options ZeRO++ fixes: they are not options of zeropp.
_FSDP2_SETTINGS: dict[str, Any] = {
    "sharding": "full",
    "data_parallel_shard_size": "auto",
    "data_parallel_replicate_size": 1,
    "reshard_after_forward": None,
}


def _describe_settings() -> str:
    return ", ".join(f"{name}={value!r}" for name, value in _FSDP2_SETTINGS.items())


class ZeroPPStrategy(FSDP2Strategy):
    """ZeRO++ (arXiv 2306.10209): ZeRO-3 (FSDP2 ``fully_shard``) with three communication cuts.

    * qwZ (``quantized_weights``): the parameter all-gather moves blockwise int8 with an fp32 scale per block
      (0.5× the bf16 bytes plus the scales); every rank dequantizes every slot, its own included.
    * hpZ (``hpz_partition_size``): after forward each unit keeps a 1/k slice of its gathered weights, k = ranks per
      node, so backward all-gathers stay inside the node (FSDP2's ``reshard_after_forward=k``). Every unit is
      resharded before each optimizer step and after each evaluation loop, so no forward sees stale weights.
    * qgZ (``quantized_gradients``): the gradient reduce-scatter becomes a quantized all-to-all in two hops (inside
      the node, then across nodes) with fp32 accumulation between them, int4 packed two per byte by default; each
      rank ends with the mean of its own shard.

    Checkpoints are plain FSDP2/DCP: a ``zeropp`` checkpoint resumes under ``fsdp2`` and the other way round.

    Args:
        quantized_weights: qwZ.
        hpz_partition_size: hpZ: ranks of the secondary partition; ``"auto"`` = ranks per node; ``None`` turns it off.
            Must divide the sharding group and be smaller than it.
        quantized_gradients: qgZ.
        weight_bits: Bits of the quantized all-gather (8 or 4).
        gradient_bits: Bits of the quantized reduce-scatter (4 or 8).
        weight_block_size: Elements per weight quantization block (one fp32 scale each).
        gradient_block_size: Elements per gradient quantization block.
        ranks_per_node: Ranks on each node; ``None``: the Trainer's ``devices`` (processes per node). Declaring
            fewer than there are simulates several nodes on one machine.
        cpu_offload: As for :class:`~lightning_dist.FSDP2Strategy`; cannot be combined with hpZ.
        config: A DeepSpeed config (a dict, or the path of its JSON file) as ``DeepSpeedStrategy(config=...)`` takes
            it: ``zero_optimization.stage`` 3 and its ZeRO++ keys (``zero_quantized_weights``,
            ``zero_hpz_partition_size``, ``zero_quantized_gradients``, ``offload_param``/``offload_optimizer``) set
            the options above; keys that size DeepSpeed's own buffers, and the Trainer's (batch sizes, precision,
            clipping), are accepted with a note; any other key is refused by name.
        **kwargs: The options every strategy takes (``wrap_modules``, ``activation_checkpointing``,
            ``accumulation_sync``, whose ``"last"`` skips the quantized reduce-scatter on all but the last
            micro-batch, ...): see :class:`~lightning_dist.strategies.base.MeshParallelStrategy`. Not
            ``reshard_after_forward``: hpZ (``hpz_partition_size``) is ZeRO++'s own form of it.
    """

    log_name = "zeropp"

    def __init__(
        self,
        quantized_weights: bool = True,
        hpz_partition_size: int | Literal["auto"] | None = "auto",
        quantized_gradients: bool = True,
        weight_bits: int = 8,
        gradient_bits: int = 4,
        weight_block_size: int = 256,
        gradient_block_size: int = 256,
        ranks_per_node: int | None = None,
        cpu_offload: bool = False,
        config: dict[str, Any] | str | None = None,
        **kwargs: Any,
    ) -> None:
        if config is not None:  # a DeepSpeed ZeRO++ config: its keys set the options above
            options, notes = from_deepspeed_config(config)
            quantized_weights, quantized_gradients = options["quantized_weights"], options["quantized_gradients"]
            hpz_partition_size, cpu_offload = options["hpz_partition_size"], options["cpu_offload"]
            for note in notes:
                rank_zero_info(f"zeropp: {note}")
        owned = sorted(set(kwargs) & set(_FSDP2_SETTINGS))
        if owned:
            raise TypeError(
                f"ZeroPPStrategy sets {', '.join(owned)} itself ({_describe_settings()}): ZeRO++ needs full sharding"
                " over all ranks and keeps its own secondary weight partition (hpz_partition_size). Remove the"
                " option, or use FSDP2Strategy to choose it."
            )
        # Spelt out, not **_FSDP2_SETTINGS: jsonargparse reads this call to know they are not options of zeropp.
        super().__init__(
            sharding="full",
            data_parallel_shard_size="auto",
            data_parallel_replicate_size=1,
            reshard_after_forward=None,
            cpu_offload=cpu_offload,
            **kwargs,
        )
        for name, bits in (("weight_bits", weight_bits), ("gradient_bits", gradient_bits)):
            try:
                check_bits(bits)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        for name, block in (("weight_block_size", weight_block_size), ("gradient_block_size", gradient_block_size)):
            try:
                check_block_size(block)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        hpz = hpz_partition_size
        if hpz is not None and hpz != "auto" and not is_positive_int(hpz, 2):
            raise ValueError(
                f"hpz_partition_size={hpz!r} must be 'auto' (ranks per node), an int >= 2, or None (hpZ off)."
            )
        if isinstance(hpz, int) and cpu_offload:
            raise ValueError(HPZ_OFFLOAD)
        if ranks_per_node is not None:
            check_positive_int("ranks_per_node", ranks_per_node)
        self.quantized_weights = check_bool("quantized_weights", quantized_weights)
        self.hpz_partition_size = hpz
        self.quantized_gradients = check_bool("quantized_gradients", quantized_gradients)
        self.weight_bits = weight_bits
        self.gradient_bits = gradient_bits
        self.weight_block_size = weight_block_size
        self.gradient_block_size = gradient_block_size
        self.ranks_per_node = ranks_per_node
        self._hpz: int | None = None  # resolved in resolve_mesh_options
        self._node_groups: NodeGroups | None = None

    # ------------------------------------------------------------------ precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> FSDP2Precision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroPPPrecision()
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        plugin = to_fsdp2_precision(precision_plugin)
        if plugin is not None and type(plugin) is FSDP2Precision and precision_plugin is not plugin:
            plugin = ZeroPPPrecision(plugin.precision)  # a generic plugin from the Trainer's precision= flag
        self._precision_plugin = plugin

    # ------------------------------------------------------------------ topology
    @property
    def resolved_ranks_per_node(self) -> int:
        """Ranks per node: the declared value, else the processes the Trainer starts per node (``devices``)."""
        return self.ranks_per_node if self.ranks_per_node is not None else max(1, self.num_processes)

    @override
    def resolve_mesh_options(self, dims: ParallelDims) -> None:
        """The hpZ partition size, against the sharding group's size and the ranks per node."""
        self._hpz = resolve_hpz(
            self.hpz_partition_size,
            dims.fsdp,
            self.resolved_ranks_per_node,
            self.quantized_gradients,
            self.cpu_offload,
            rank_zero_warn,
        )

    @property
    @override
    def fsdp_config(self) -> FSDPConfig:
        config = super().fsdp_config
        config.reshard_after_forward = self._hpz if self._hpz is not None else True
        return config

    # ------------------------------------------------------------------ model
    @override
    def extra_shard_units(self, model: Module, units: list[tuple[str, Module]]) -> list[tuple[str, Module]]:
        return leftover_param_modules(model, [m for _, m in units]) if self._hpz else []

    @override
    def parallelize_config(self, model: Module) -> ParallelizeConfig:
        _ = self.parallel_dims  # resolves hpZ before fsdp_config is read
        config = super().parallelize_config(model)
        dims = self.parallel_dims
        compiled = self.compiles_quantization
        if self.quantized_weights:
            config.all_gather = QuantizedAllGather(
                dims.fsdp, bits=self.weight_bits, block_size=self.weight_block_size, compiled=compiled
            )
        if self.quantized_gradients:
            config.reduce_scatter = QuantizedReduceScatter(
                self._groups(), bits=self.gradient_bits, block_size=self.gradient_block_size, compiled=compiled
            )
        return config

    @override
    def comms_log(self, record: ParallelizeRecord) -> list[str]:
        per_node = self.resolved_ranks_per_node
        parts = [
            f"qwZ int{self.weight_bits}/block {self.weight_block_size}" if self.quantized_weights else "qwZ off",
            f"hpZ over {self._hpz} ranks" if self._hpz else "hpZ off",
            f"qgZ int{self.gradient_bits}/block {self.gradient_block_size}" if self.quantized_gradients else "qgZ off",
        ]
        nodes = self.parallel_dims.fsdp // per_node
        kernels = "compiled" if self.compiles_quantization else "eager"
        if self.quantized_weights or self.quantized_gradients:
            parts.append(f"quantization kernels {kernels}")
        return [f"{', '.join(parts)} on {record.fsdp_modules} FSDP units; {nodes} node(s) × {per_node} ranks"]

    def verification_tolerance(self) -> tuple[float, str, tuple[str, ...]] | None:
        """What ``lightning-dist verify`` may hold this strategy to: with qwZ or qgZ on, the weights and gradients
        are quantized on purpose, so the losses and logged values are judged within 5e-2 relative (the bound the
        package's ZeRO++ tests hold over 20 steps) and gradients, parameters and optimizer states are shown only."""
        if not (self.quantized_weights or self.quantized_gradients):
            return None
        what = " and ".join(
            part
            for part, on in ((f"int{self.weight_bits} weights", self.quantized_weights),
                             (f"int{self.gradient_bits} gradients", self.quantized_gradients))
            if on
        )  # fmt: skip
        return 5e-2, f"ZeRO++ communicates {what} on purpose", ("loss", "logged")

    def _groups(self) -> NodeGroups:
        if self._node_groups is None:  # created once, by every rank, in the same order
            ranks = dist.get_process_group_ranks(self.process_group("fsdp"))
            self._node_groups = new_node_groups(ranks, self.resolved_ranks_per_node)
        return self._node_groups
