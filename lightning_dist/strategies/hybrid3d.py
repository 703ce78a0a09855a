"""Hybrid3DStrategy: any mesh of ``pp × dp_replicate × dp_shard × cp × tp`` for an unchanged LightningModule.

The single strategies are presets of the same pieces; this one turns every axis on at once. Per pipeline stage,
in torchtitan's order: the pipeline split → tensor parallelism → activation checkpointing → compile → FSDP2 (HSDP
with ``dp_replicate``) over ``dp_shard × cp`` → the schedule. Each stage shards over its own tp and fsdp groups
(a stage's ranks share a pp coordinate). Steps: a context-parallel batch is sharded on the sequence first, its
global positions join the pipelined call's arguments, and attention is dispatched to the cp group for the whole
step; the pipeline then runs that call through its schedule (see the pipeline and context-parallel strategies).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch.distributed as dist
from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel.fsdp import is_fully_sharded
from lightning_dist.parallel.mesh import MeshConfigError, ParallelDims
from lightning_dist.parallel.parallelize import ParallelizeConfig, parallelize
from lightning_dist.parallel.validation import check_bool
from lightning_dist.parallel.zeropp import QuantizedAllGather
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize
from lightning_dist.strategies.hybrid3d_mesh import (
    check_pipelined_context_parallel,
    planner_sizes,
    refuse_stages_without_tensor_parallel,
    sizes_from_options,
)
from lightning_dist.strategies.parallelisms.context_parallel.sequence_shards import ContextParallelSteps
from lightning_dist.strategies.parallelisms.expert_parallel import ExpertParallelOption
from lightning_dist.strategies.parallelisms.fault_tolerance import FaultToleranceOption, FaultToleranceSpec
from lightning_dist.strategies.parallelisms.pipeline.stages import Split
from lightning_dist.strategies.parallelisms.pipeline.step import PipelineSteps
from lightning_dist.strategies.parallelisms.tensor_parallel import PlanSpec, TensorParallelSteps


class Hybrid3DStrategy(
    ContextParallelSteps,
    TensorParallelSteps,
    PipelineSteps,
    ExpertParallelOption,
    FaultToleranceOption,
    MeshParallelStrategy,
):
    """Pipeline, data (FSDP2/HSDP), context and tensor parallelism in one mesh, for an unchanged LightningModule.

    Give the mesh as sizes (one may be ``"auto"``: it takes the processes the others leave; by default
    ``data_parallel_shard_size``), as ``mesh_shape: [[2, 2, 2], ["pp", "dp_shard", "tp"]]``, or as ``mesh="auto"``
    to use the planner's recommendation (``lightning-dist plan --devices``) for the model, the number of processes
    and ``sequence_length``. The other options are those of the single strategies, under the same names; each
    applies only where its axis has more than one rank.

    Limits: the pipelined call under ``pp × cp`` must be the module that takes the positions argument (or holds the
    rotary tables it slices by the length, as litgpt's ``GPT``), and a Hugging Face causal LM given ``labels=`` is
    refused under ``pp × cp`` on the first step (its label shift crosses shard and micro-batch boundaries; computing
    the loss in ``training_step`` from the logits trains); ``zeropp`` quantizes the FSDP2 all-gather of weights (qwZ),
    not the gradients.

    Args:
        pipeline_parallel_size: Pipeline stages' ranks (``pp``).
        data_parallel_replicate_size: Replica groups of HSDP (``dp_replicate``): parameters are replicated across
            them and sharded inside each.
        data_parallel_shard_size: FSDP2 ranks that see different samples (``dp_shard``); default: the processes
            the other sizes leave (1 when another size is ``"auto"``).
        context_parallel_size: Ranks a sequence is split over (``cp``); FSDP2 shards over ``dp_shard × cp``.
        tensor_parallel_size: Ranks a layer is split over (``tp``).
        expert_parallel_size: Ranks that split every mixture-of-experts layer's experts (``ep``), borrowed from
            ``dp_shard × cp`` (it must divide it and the experts; ``"auto"``: all of it), inside each pipeline stage;
            the experts are replicated over ``tp``. Under ``mesh="auto"`` the planner chooses it for a
            mixture-of-experts model when left at 1, and keeps it when given. See docs/expert_parallel.md.
        expert_modules, log_expert_load: As in :class:`~lightning_dist.FSDP2Strategy`: a pattern naming the
            experts modules the structure does not show; log each MoE layer's max / mean tokens per expert.
        expert_dispatch_chunks: As in :class:`~lightning_dist.FSDP2Strategy`: each MoE layer's tokens sent in that
            many chunks, each chunk's all-to-all overlapping the experts' work on another (1: none).
        mesh_shape: ``[sizes, axis names]`` instead of the size options (names: pp, dp_replicate, dp_shard or dp,
            cp, tp; axes left out have size 1).
        mesh: ``"auto"``: the planner chooses the sizes (needs ``sequence_length``); the choice is logged.
        schedule: Pipeline schedule (see the ``pipeline`` strategy).
        n_microbatches: Micro-batches per step; default chosen from the per-replica batch size.
        stages_per_rank: Pipeline stages each rank holds (multi-stage schedules).
        split: Where pipeline stages begin: ``"auto"``, module names, or one list of module names per stage.
        attention: Context-parallel attention: ``"ring"``, ``"allgather"`` or ``"ulysses"``.
        load_balance: ``"zigzag"`` or ``"contiguous"`` sequence layout.
        sequence_keys: Batch entries that carry the sequence (see the ``context_parallel`` strategy).
        plan: Explicit tensor-parallel plan (see the ``tensor_parallel`` strategy); default: the automatic one.
        sequence_parallel: Norms and the residual stream run on a slice of the sequence over ``tp``.
        loss_parallel: The head's logits stay sharded on the vocabulary for the cross-entropy.
        zeropp: Quantize FSDP2's weight all-gather to int8 (ZeRO++ qwZ) over ``dp_shard × cp``.
        sequence_length: Tokens per sample, for ``mesh="auto"`` (also checked against ``2·cp`` before launch).
        micro_batch_size: Samples per data-parallel rank per forward, for ``mesh="auto"``.
        device_memory_gib: Memory per device for ``mesh="auto"``; default: the GPU's, unchecked on CPU.
        fault_tolerance: This job is one replica group of several kept in step by torchft, as in
            :class:`~lightning_dist.FSDP2Strategy` (any mesh: the replicate axis across groups is torchft's). See
            docs/fault_tolerance.md.
        **kwargs: The options every strategy takes (``reshard_after_forward``, off by default under ``pp``,
            ``wrap_modules``, ``wrap_regex``, ``activation_checkpointing``, ``accumulation_sync``, ``compile``...):
            see :class:`~lightning_dist.strategies.base.MeshParallelStrategy`.
    """

    log_name = "hybrid3d"
    parallelized_state = ("_rope_in_parts",)  # see lifecycle/model_handover

    def __init__(
        self,
        pipeline_parallel_size: MeshSize = 1,
        data_parallel_replicate_size: MeshSize = 1,
        data_parallel_shard_size: MeshSize | None = None,
        context_parallel_size: MeshSize = 1,
        tensor_parallel_size: MeshSize = 1,
        expert_parallel_size: MeshSize = 1,
        expert_modules: str | None = None,
        log_expert_load: bool = False,
        expert_dispatch_chunks: int = 1,
        mesh_shape: list[list[int | str]] | None = None,
        mesh: Literal["auto"] | None = None,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        stages_per_rank: int | None = None,
        split: Split = "auto",
        attention: str = "ring",
        load_balance: str = "zigzag",
        sequence_keys: list[str] | None = None,
        plan: PlanSpec | None = None,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        zeropp: bool = False,
        sequence_length: int | None = None,
        micro_batch_size: int = 1,
        device_memory_gib: float | None = None,
        fault_tolerance: FaultToleranceSpec = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.init_pipeline(schedule, n_microbatches, stages_per_rank, split)
        self.init_context_parallel(attention, load_balance, sequence_keys)
        self.init_tensor_parallel(plan, sequence_parallel, loss_parallel)
        self.init_expert_parallel(expert_parallel_size, expert_modules, log_expert_load, expert_dispatch_chunks)
        self.init_fault_tolerance(fault_tolerance)
        self._rope_in_parts: str | None = None  # under pp × cp: the rope-table module's name in each stage
        sizes = {
            "pp": pipeline_parallel_size,
            "dp_replicate": data_parallel_replicate_size,
            "dp_shard": data_parallel_shard_size,
            "cp": context_parallel_size,
            "tp": tensor_parallel_size,
        }
        if mesh not in (None, "auto"):
            raise ValueError(f"mesh={mesh!r}: pass 'auto' for the planner's mesh, or leave it out and give the sizes.")
        self.mesh_choice = mesh
        self._recommended: dict[str, MeshSize] | None = None
        self._sizes = sizes_from_options(sizes, mesh_shape, mesh)
        self.mesh_shape = mesh_shape
        self.zeropp = check_bool("zeropp", zeropp)
        if mesh == "auto" and sequence_length is None:
            raise ValueError(
                "mesh='auto' needs sequence_length (tokens per sample) to estimate activation memory; also set"
                " micro_batch_size (default 1) and, off GPU, device_memory_gib."
            )
        self.sequence_length = sequence_length
        self.micro_batch_size = micro_batch_size
        self.device_memory_gib = device_memory_gib

    # ------------------------------------------------------------------ mesh
    @override
    def mesh_sizes(self) -> dict[str, MeshSize]:
        sizes = self._recommended_sizes() if self.mesh_choice == "auto" else self._sizes
        return {**sizes, **self.expert_parallel_sizes()}

    @override
    def mesh_is_known(self) -> bool:
        return self.mesh_choice != "auto" or self.lightning_module is not None

    def _recommended_sizes(self) -> dict[str, MeshSize]:
        if self._recommended is None:  # once: the launching process may have asked before launch (preflight)
            self._recommended = planner_sizes(self)
        return self._recommended

    @override
    def agree_on_mesh(self) -> None:
        """``mesh="auto"``: every rank trains on rank 0's choice. Each process runs the planner itself, and ranks
        that see different device memory (mixed GPUs, another job's memory) could choose different meshes, which
        would hang or train wrongly; a rank whose choice differs says so."""
        if self.mesh_choice != "auto" or self.world_size == 1:
            return
        mine = self._recommended_sizes()
        chosen = [mine]
        dist.broadcast_object_list(chosen, src=0)
        if chosen[0] != mine:
            warnings.warn(  # from every rank that differs, not from rank 0 alone
                f"hybrid3d rank {self.global_rank}: mesh='auto' chose {ParallelDims(**mine)} here and"
                f" {ParallelDims(**chosen[0])} on rank 0; training on rank 0's (do the ranks see different device"
                " memory? set device_memory_gib to plan for the smallest)."
            )
            self._recommended = chosen[0]
            self.resolve_mesh_again()

    @override
    def validate_mesh(self, dims: ParallelDims) -> None:
        cp = dims.cp
        if self.sequence_length is not None and cp > 1:
            multiple = cp if self.load_balance == "contiguous" else 2 * cp
            if self.sequence_length % multiple:
                raise MeshConfigError(
                    f"sequence_length={self.sequence_length} is not divisible by {multiple}"
                    f" ({'cp' if multiple == cp else '2·cp'} with context_parallel_size={cp}, {self.load_balance}"
                    " layout). Choose a sequence length or context_parallel_size that divides."
                )

    # ------------------------------------------------------------------ the model
    @override
    def check_model(self, model: Module) -> None:
        dims = self.parallel_dims
        self.check_expert_parallel_model(model, self.sequence_parallel)
        plan = self.keep_experts_whole(self.tensor_parallel_plan(model), model) if dims.tp > 1 else None
        if plan is not None:
            if dims.pp > 1:
                plan.tied.clear()  # each stage holds its own copy of a tied weight, summed in a common layout
            plan.validate(dims.tp)
        if dims.cp > 1:
            self.check_context_parallel_model(model)
        if dims.pp > 1:
            stages = self.check_pipeline_model(model)
            if plan is not None and not plan.explicit:
                refuse_stages_without_tensor_parallel(model, plan, stages)
        else:
            self.shard_units(model)  # refuses a wrap_modules/wrap_regex choosing nothing

    @override
    def parallelize(self, model: Module) -> Module:
        if is_fully_sharded(model):
            raise ValueError(
                "The model's configure_model already applied fully_shard; the hybrid3d strategy applies tensor"
                " parallelism and FSDP2 itself, in that order. Remove fully_shard from configure_model."
            )
        dims = self.parallel_dims
        if dims.cp > 1:
            self.prepare_context_parallel(model)
        if self.pipelined:
            stages = self.cut_stages(model)
            self._rope_in_parts = check_pipelined_context_parallel(self, model)
        else:
            stages = [(model, self.shard_units(model))]
        last = self.stage_plan.num_stages - 1 if self.pipelined else 0
        for (part, blocks), stage in zip(stages, self.stage_ids if self.pipelined else [0]):
            plan = self.tensor_parallel_plan(part, needs_head=stage == last) if dims.tp > 1 else None
            plan = plan and self.keep_experts_whole(plan, part)
            config, root = self._parallelize_config(blocks, plan, feeds_loss=stage == last), type(part).__name__
            config.expert_parallel, config.expert_modules = self.expert_parallel_on(part), self.expert_modules
            config.expert_dispatch_chunks = self.expert_dispatch_chunks
            record = parallelize(part, self.mesh, config)
            if plan is not None:
                self.log_tensor_parallel_plan(model, plan, record.tp_changes)
        self.model_parts = [part for part, _ in stages]
        extras = [f"int8 weight all-gather (qwZ) on {record.comms_units} units"] if config.all_gather else []
        if dims.cp > 1:
            extras.append(f"{self.attention} attention over cp={dims.cp} ({self.load_balance} layout)")
        self.log_layout(config, record, root, per_stage=self.pipelined, extras=extras)
        return model

    def _parallelize_config(self, blocks: list[tuple[str, Module]], plan: Any, feeds_loss: bool) -> ParallelizeConfig:
        config, fsdp = self.standard_parallelize_config(blocks, plan, feeds_loss), self.parallel_dims.fsdp
        if self.zeropp and fsdp > 1:
            config.all_gather = QuantizedAllGather(fsdp, compiled=self.compiles_quantization)
        return config

    @override
    def rope_modules(self) -> list[Module]:
        if not self.pipelined or self._rope_in_parts is None:
            return super().rope_modules()
        return [part.get_submodule(self._rope_in_parts) for part in self.model_parts]

    # ------------------------------------------------------------------ steps
    @override
    def pipeline_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        module = self.pipelined_module
        if self.context_parallel and self.causal_lm is not None and inputs.get("labels") is not None:
            raise ValueError(
                "hybrid3d: pipeline × context parallelism cannot pass a Hugging Face causal LM its labels (the"
                " model's label shift crosses both the sequence shards and the micro-batches), and training_step"
                f" passes labels= to {type(module).__name__}. Call the model without labels and compute the loss"
                " in training_step from the logits, with labels aligned per position in the batch (shifted by the"
                " dataset), or drop one of pp and cp."
            )
        if not self.context_parallel or self.positions_argument is None or self.batch_sequence_length is None:
            return inputs
        filled = self.positions_hook(module)(module, (), inputs)
        return inputs if filled is None else filled[1]
