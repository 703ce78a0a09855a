"""The base of the Fabric strategies: Lightning Fabric's strategy interface over a Trainer strategy of this package.

A Fabric strategy is an adapter, not a second implementation. It builds the Trainer strategy of the same name with
the same options (its *engine*: the option checks, the mesh, the automatic plans, the precision policy, the
checkpoint IO) and answers Fabric's calls with the engine's pieces: the processes and the mesh at
``fabric.launch()`` (:meth:`~lightning_dist.strategies.lifecycle.processes.ProcessSetup.start_processes`), the model's
parallelization at ``fabric.setup`` (:meth:`~lightning_dist.strategies.lifecycle.model_setup.ModelSetup.prepare_model`),
reductions over the mesh's groups, gradients made what one process computes before clipping and stepping, and
checkpoints in the Trainer's format (:mod:`.checkpoints`).

What only the Trainer's loop can drive is refused by name when the strategy is built (:mod:`.refusals`), and so
is a pipeline axis: Fabric has no step structure for a schedule to run.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dist.compat.lightning import FabricSubprocessScriptLauncher, set_strategy_module
from lightning_dist.fabric.checkpoints import load_state, save_state
from lightning_dist.fabric.no_sync import ShardedNoSync
from lightning_dist.fabric.precision import FabricMeshPrecision, engine_precision_plugin, precision_flag
from lightning_dist.fabric.refusals import refuse_pipeline, refuse_trainer_only
from lightning_dist.fabric.sequence_shards import FabricSequenceShards
from lightning_dist.parallel.fsdp import is_fully_sharded
from lightning_dist.parallel.full_tensor_loading import accept_full_tensors
from lightning_dist.parallel.grad_clip import clip_grad_norm_, clip_grad_value_
from lightning_dist.strategies.base import MeshParallelStrategy
from lightning_dist.strategies.lifecycle.peer_batches import seed_workers_by_data_parallel_rank
from lightning_dist.strategies.lifecycle.preflight import PARALLELIZED


class MeshFabricStrategy(ParallelStrategy):
    """Base of the lightning_dist Fabric strategies (not registered itself).

    Args:
        accelerator, parallel_devices, cluster_environment: Set by Fabric.
        checkpoint_io: One of lightning_dist's checkpoint IO plugins (default: sharded, as the Trainer's).
        precision: Set by Fabric from ``Fabric(precision=...)``.
        **options: The options of the Trainer strategy of the same name (:attr:`engine_class`), with the same
            meaning and defaults.
    """

    #: The Trainer strategy whose options, mesh and parallelization this Fabric strategy applies.
    engine_class: ClassVar[type[MeshParallelStrategy]]

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        **options: Any,
    ) -> None:
        refuse_trainer_only(type(self).__name__, options)
        #: The Trainer strategy doing the work (see the module docstring).
        self.engine: MeshParallelStrategy = self.engine_class(checkpoint_io=checkpoint_io, **options)  # type: ignore[arg-type]
        super().__init__(accelerator=accelerator)
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        if precision is not None:
            self.precision = precision
        self._backward_sync_control = ShardedNoSync()
        self._sequence_shards: FabricSequenceShards | None = None
        self._gradients_pending = False

    # ------------------------------------------------------------------ what Fabric sets, kept on the engine
    @property
    @override
    def parallel_devices(self) -> list[torch.device] | None:
        return self.engine.parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self.engine.parallel_devices = devices

    @property
    def cluster_environment(self) -> ClusterEnvironment | None:  # type: ignore[override]
        return self.engine.cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, environment: ClusterEnvironment | None) -> None:
        self.engine.cluster_environment = environment

    @property
    def num_nodes(self) -> int:
        return self.engine.num_nodes

    @property
    def _num_nodes(self) -> int:
        return self.engine.num_nodes

    @_num_nodes.setter
    def _num_nodes(self, num_nodes: int) -> None:  # Fabric's connector sets it
        self.engine.num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return self.engine.num_processes

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        return self.engine.checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self.engine.checkpoint_io = io

    @property
    @override
    def precision(self) -> Precision:
        if self._precision is None:
            self._precision = FabricMeshPrecision(self.engine.precision_plugin)
        return self._precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        if precision is None:
            self._precision = None
            return
        self.engine.precision_plugin = engine_precision_plugin(precision_flag(precision), precision)
        self._precision = FabricMeshPrecision(self.engine.precision_plugin)

    @property
    @override
    def root_device(self) -> torch.device:
        return self.engine.root_device

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Ranks that differ only in cp or tp get the same samples: replicas are the mesh's ``batch`` group."""
        return self.engine.distributed_sampler_kwargs

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Workers seeded by ``seed_everything(workers=True)`` draw alike on tensor and context peers."""
        seed_workers_by_data_parallel_rank(dataloader, self.distributed_sampler_kwargs["rank"])
        return dataloader

    @property
    def device_mesh(self) -> Any:
        """The 5-D DeviceMesh ``(pp, dp_replicate, dp_shard, cp, tp)`` (Lightning's ``ModelParallelStrategy`` name)."""
        return self.engine.device_mesh

    # ------------------------------------------------------------------ processes
    def _set_world_ranks(self) -> None:
        self.engine.set_world_ranks()  # the mesh sizes checked, before any process is launched
        if self.engine.num_processes and self.engine.mesh_is_known():
            refuse_pipeline(type(self).__name__, self.engine.parallel_dims.pp)

    @override
    def _configure_launcher(self) -> None:
        environment = self.cluster_environment
        assert environment is not None
        if not environment.creates_processes_externally:
            self._launcher = FabricSubprocessScriptLauncher(environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.engine.start_processes()

    # ------------------------------------------------------------------ the model
    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        # empty_init=True: built on the meta device, materialized after parallelizing in setup_module
        return self.engine.tensor_init_context(empty_init)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        if optimizers:  # they hold the parameters that sharding is about to replace
            raise RuntimeError(
                f"{type(self).__name__} shards the model's parameters when it sets the model up, so an optimizer made"
                " before would update parameters the model no longer uses. Set the model up first, then make the"
                " optimizer from its parameters: `model = fabric.setup(model)`, then"
                " `optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`."
            )
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def setup_module(self, module: Module) -> Module:
        engine = self.engine
        engine.model = module
        set_strategy_module(engine, module)  # the module the step parts find submodules in
        if getattr(module, PARALLELIZED, None) is None:
            if not is_fully_sharded(module):
                engine.check_model(module)  # head counts, units...: every rank refuses alike, before any collective
            engine.check_initial_weights_before_launch(module, None, None)  # the files' headers against the model
            engine.prepare_model()
        engine.finish_model_setup()
        accept_full_tensors(engine.model)  # model.load_state_dict(torch.load(...)) as on one device (litgpt does it)
        if engine.parallel_dims.cp > 1:
            self._sequence_shards = FabricSequenceShards(engine, engine.model)  # type: ignore[arg-type]
        engine.barrier()
        return engine.model

    @override
    def module_to_device(self, module: Module) -> None:
        pass  # placed in setup_module, after sharding

    # ------------------------------------------------------------------ steps
    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        try:
            super().backward(tensor, module, *args, **kwargs)
        finally:
            if self._sequence_shards is not None:
                self._sequence_shards.close_step()
        self._gradients_pending = True

    def finish_gradients(self) -> None:
        """Once per optimizer step, before clipping or stepping: the gradients made what one process computes (tensor
        parallelism's replicated and per-head parameters)."""
        if self._gradients_pending:
            self._gradients_pending = False
            for part in self.engine.step_parts():
                part.make_gradients_consistent()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.finish_gradients()
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self.finish_gradients()
        self.precision.unscale_gradients(optimizer)
        norm = clip_grad_norm_(self.precision.main_params(optimizer), max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} of the gradients is non-finite ({norm.item()}), so it"
                " cannot be clipped. Set error_if_nonfinite=False in fabric.clip_gradients to clip anyway."
            )
        return norm

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float) -> None:
        self.finish_gradients()
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(self.precision.main_params(optimizer), clip_val)

    # ------------------------------------------------------------------ collectives
    @override
    def all_reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Any:
        """Over the data-parallel ranks that hold different samples (× cp) by default: tensor-parallel peers hold
        the same loss and are not counted twice."""
        return self.engine.reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return self.engine.all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def barrier(self, name: str | None = None) -> None:
        self.engine.barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.engine.broadcast(obj, src)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options.")
        save_state(self.engine, Path(self.broadcast(str(path))), state, filter)

    @override
    def load_checkpoint(
        self,
        path: str | Path,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        if not state:
            raise ValueError(
                f"{type(self).__name__} loads a checkpoint into the objects it restores: fabric.load(path,"
                " {'model': model, 'optimizer': optimizer, ...})."
            )
        path = Path(self.broadcast(str(path)))
        self.engine.checkpoint_io.wait()
        return load_state(self.engine, path, state, strict, weights_only)  # type: ignore[arg-type]

    @override
    def teardown(self) -> None:
        engine = self.engine
        if self._sequence_shards is not None:
            self._sequence_shards.remove()
        engine.finish_watchdog()
        try:
            engine.checkpoint_io.teardown()  # a save still in flight is awaited, and its failure raised
        finally:
            if self.cluster_environment is not None:
                self.cluster_environment.teardown()
            self.precision.teardown()
            if self.accelerator is not None:
                self.accelerator.teardown()
