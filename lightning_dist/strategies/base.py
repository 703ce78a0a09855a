"""The shared base of every lightning_dist strategy.

It owns what all six strategies share: the process group and the one N-D mesh, launching (with the checks of
:mod:`.preflight` first), the sampler's view of data parallelism, collectives for logging, precision-plugin
conversion, meta-device materialization and placement, equal replicated copies across ranks, gradient accumulation,
sharded checkpoints and gradient clipping. A concrete strategy says which mesh it wants (:meth:`mesh_sizes`), what
it can check before launch (:meth:`check_model`) and how to parallelize the model on the mesh (:meth:`parallelize`).
Pipeline and context parallel will use the extension hooks :meth:`transform_batch` and :meth:`run_training_step`.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import warnings
from collections.abc import Generator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dist.checkpoint import model_state as states
from lightning_dist.checkpoint.layout import PROVENANCE_KEY
from lightning_dist.parallel.fsdp import is_fully_sharded, reshard_all
from lightning_dist.parallel.gradient_sync import AccumulationSync, deferred_gradient_sync
from lightning_dist.parallel.mesh import ParallelDims, ParallelMesh
from lightning_dist.parallel.placement import place_model
from lightning_dist.parallel.replicated_state import (
    average_gradients,
    broadcast_replicated_state,
    tp_replicated_parameters,
)
from lightning_dist.plugins.checkpoint_io import DistributedCheckpointIO, ParallelCheckpointIO
from lightning_dist.plugins.precision import FSDP2Precision, to_fsdp2_precision
from lightning_dist.strategies.data_position import (
    LIGHTNING_NOT_RESUMABLE_WARNING,
    skip_trained_batches,
    training_position,
)
from lightning_dist.strategies.preflight import (
    PreflightLauncher,
    PreflightSubprocessLauncher,
    check_checkpoint_callbacks,
    check_ckpt_path,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MeshSize = int | Literal["auto"]
# Set on a model once parallelized: the strategy settings that did it (see MeshParallelStrategy.parallel_settings).
_PARALLELIZED = "_lightning_dist_parallelized"
# Constructor arguments every strategy shares with Lightning's: they do not change how a model is parallelized.
_BASE_ARGUMENTS = (
    "self",
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
    "timeout",
)


class MeshParallelStrategy(ParallelStrategy):
    """Base of all lightning_dist strategies (not registered itself).

    Args:
        accelerator: Set by the Trainer.
        parallel_devices: Set by the Trainer from ``devices=``.
        cluster_environment: Set by the Trainer (torchrun/SLURM environments create processes themselves).
        checkpoint_io: Defaults to :class:`~lightning_dist.plugins.DistributedCheckpointIO` (sharded);
            :class:`~lightning_dist.plugins.AsyncDistributedCheckpointIO` saves in the background and
            :class:`~lightning_dist.plugins.FullStateCheckpointIO` writes one consolidated file. Any of them can also
            be passed as ``Trainer(plugins=[...])``.
        precision_plugin: Usually left out; the Trainer's ``precision=`` is converted to
            :class:`~lightning_dist.plugins.FSDP2Precision`.
        process_group_backend: ``"gloo"`` on CPU and ``"nccl"`` on CUDA unless given.
        timeout: Timeout for collectives.
    """

    #: Short name used in log lines ("fsdp2: ...").
    log_name: str = "lightning_dist"

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.checkpoint_io = checkpoint_io  # through the setter, which refuses plugins that cannot write shards
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._dims: ParallelDims | None = None
        self._mesh: ParallelMesh | None = None
        self._resume_position: dict[str, Any] | None = None
        self._resume_loader_index = 0
        self._tp_replicated: list[torch.nn.Parameter] = []
        self._train_context: ExitStack | None = None
        self.num_nodes = 1

    # ------------------------------------------------------------------ what a concrete strategy provides
    def mesh_sizes(self) -> dict[str, MeshSize]:
        """Requested sizes of the mesh axes (``pp, dp_replicate, dp_shard, cp, tp``); one may be ``"auto"``."""
        raise NotImplementedError

    def validate_mesh(self, dims: ParallelDims) -> None:
        """Check strategy-specific constraints on the resolved mesh (before any process group is created)."""

    def parallelize(self, model: Module) -> Module:
        """Apply this strategy's parallelism to ``model`` (on every rank, after the mesh exists); return the module
        the Trainer should run (a pipeline strategy returns its stage)."""
        raise NotImplementedError

    def check_model(self, model: Module) -> None:
        """Check ``model`` against this strategy's options before any process is launched (e.g. that the classes to
        wrap exist, that head counts divide the TP size). Only called for models whose layers all exist already
        (no ``configure_model``) and that no Trainer has parallelized yet."""

    # ------------------------------------------------------------------ extension hooks (pipeline, context parallel)
    def transform_batch(self, batch: Any, dataloader_idx: int = 0) -> Any:
        """Transform a batch after it reached the device (context parallel shards it on the sequence dim)."""
        return batch

    def run_training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the training step through the root module's ``__call__`` (so FSDP's root hooks run).

        A strategy that takes over the step (pipeline: forward and backward inside its schedule) overrides this and
        turns off Lightning's own backward for automatic optimization.
        """
        return self._forward_redirection(self.model, self.lightning_module, "training_step", *args, **kwargs)

    # ------------------------------------------------------------------ mesh
    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved mesh sizes. Available once the strategy is connected to a Trainer."""
        if self._dims is None:
            self._dims = ParallelDims.resolve(self.world_size, **self.mesh_sizes())
            self.validate_mesh(self._dims)
        return self._dims

    @property
    def mesh(self) -> ParallelMesh:
        """The mesh: ``mesh["dp_shard"]``, ``mesh["tp"]``... for axes; ``mesh["batch"|"fsdp"|"loss"]`` for groups."""
        if self._mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have been initialized (setup).")
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 5-D DeviceMesh ``(pp, dp_replicate, dp_shard, cp, tp)``, also set as ``LightningModule.device_mesh``."""
        return self.mesh.world

    # ------------------------------------------------------------------ processes and devices
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Ranks that differ only in pp, cp or tp get the same samples: replicas are the ``batch`` group."""
        dims = self.parallel_dims
        return {"num_replicas": dims.batch, "rank": dims.batch_rank(self.global_rank)}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            self._launcher = PreflightLauncher(self)
        else:
            self._launcher = PreflightSubprocessLauncher(
                self, self.cluster_environment, self.num_processes, self.num_nodes
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        if self.num_processes:
            # The Trainer calls this while it is being constructed: a mesh that cannot fit fails here, before any
            # process is launched, instead of in every launched process.
            self._dims = None
            _ = self.parallel_dims

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()  # also validates the mesh sizes, before any process group exists
        dims = self.parallel_dims
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        _destroy_process_groups_at_exit()
        if self._mesh is None:  # fit → test on one Trainer reuses the mesh (and its process groups)
            self._mesh = dims.build_mesh(self.root_device.type)
            self.log_decision(f"mesh {dims} over {self.world_size} processes ({self._process_group_backend})")
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._mesh.world

    # ------------------------------------------------------------------ precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> FSDP2Precision:
        if self._precision_plugin is None:
            self._precision_plugin = FSDP2Precision()
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = to_fsdp2_precision(precision_plugin)

    # ------------------------------------------------------------------ model setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if getattr(self.model, _PARALLELIZED, None) is None:
            self.model = self.precision_plugin.convert_module(self.model)
            self.model = self.parallelize(self.model)
            object.__setattr__(self.model, _PARALLELIZED, self.parallel_settings())
            # Meta-initialized (empty_init) state is created where it will live: the CPU under offload.
            _materialize_distributed_module(
                self.model, torch.device("cpu") if self.offloads_parameters else self.root_device
            )
            self.model_to_device()
            self._make_replicas_equal()
        if not is_fully_sharded(self.model):  # no FSDP2 policy to cast parameters: mixed precision is autocast
            self.precision_plugin.use_autocast(self.root_device.type)
        self._tp_replicated = tp_replicated_parameters(self.model, self.mesh)
        # Each pipeline stage holds different parameters: the norm to clip by sums over the stages.
        self.precision_plugin.stage_group = self.process_group("pp") if self.parallel_dims.pp > 1 else None
        # DTensor/FSDP2 parameters cannot be used under inference_mode (their version counters); Lightning only
        # falls back to no_grad for its own FSDP strategy and gloo, so say it for every backend.
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False
        self._sync_metrics_over_loss_group()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.offloads_parameters:
            _optimizers_to_device(self.optimizers, self.root_device)  # offloaded optimizer state stays on the CPU

    # ------------------------------------------------------------------ checks before launch
    def preflight(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        """Everything that can be checked before processes are launched (see :mod:`.preflight`): the checkpoint
        callbacks, ``ckpt_path``, a model an earlier Trainer already parallelized, and the model against the
        strategy's options (:meth:`check_model`). ``arguments`` are those of the Trainer entry point."""
        check_checkpoint_callbacks(trainer)
        check_ckpt_path(arguments.get("ckpt_path"))
        model = self.lightning_module
        if model is None:
            return
        applied = getattr(model, _PARALLELIZED, None)
        if applied is not None:
            self._check_same_parallelism(applied)
        elif not is_overridden("configure_model", model, pl.LightningModule):
            self.check_model(model)

    def parallel_settings(self) -> dict[str, str]:
        """What determines how this strategy parallelizes a model: its class, mesh, precision and own options.

        Recorded on the model when it is parallelized; a later Trainer may reuse the model only with equal settings.
        """
        settings = {
            "strategy": type(self).__name__,
            "mesh": str(self.parallel_dims),
            "precision": str(self.precision_plugin.precision),
        }
        for name in inspect.signature(type(self).__init__).parameters:
            if name not in _BASE_ARGUMENTS:
                settings[name] = repr(getattr(self, name, None))
        return settings

    def _check_same_parallelism(self, applied: dict[str, str]) -> None:
        """Refuse a model that an earlier Trainer parallelized differently: its parameters are already sharded, and
        applying other parallelism on top would train on the old layout (or fail deep inside torch)."""
        wanted = self.parallel_settings()
        if applied == wanted:
            return
        differences = ", ".join(
            f"{key}: {applied.get(key, '-')} → {wanted.get(key, '-')}"
            for key in dict.fromkeys([*applied, *wanted])
            if applied.get(key) != wanted.get(key)
        )
        raise RuntimeError(
            f"{type(self.lightning_module).__name__} was already parallelized by an earlier Trainer with"
            f" {applied['strategy']} ({differences}). A sharded model cannot be parallelized again. Give this Trainer a"
            " fresh, unsharded instance of the model (construct it again, or load one with"
            " `load_from_checkpoint` from a checkpoint the first Trainer saved), or use the first Trainer's strategy"
            " settings."
        )

    def _make_replicas_equal(self) -> None:
        """Copy every replicated parameter and buffer from the first rank of each axis it is replicated over, as DDP
        does at setup: without a seed each rank initialized its own values."""
        assert self.model is not None
        count = broadcast_replicated_state(self.model, self.mesh)
        if count:
            axes = [a for a in ("dp_replicate", "cp", "tp") if getattr(self.parallel_dims, a) > 1]
            self.log_decision(f"{count} replicated tensors made equal across {' × '.join(axes)} (from the first rank)")

    def _sync_metrics_over_loss_group(self) -> None:
        """torchmetrics ``Metric`` objects sync over WORLD by default, which counts tensor/pipeline peers (which saw
        the same samples) more than once in sum states: metrics without a group or sync function of their own
        gather over ``loss`` instead."""
        from torchmetrics import Metric

        from lightning_dist.strategies.metric_sync import gather_over_data_parallel, use_metric_group

        dims = self.parallel_dims
        if self.lightning_module is None or dims.world_size == dims.batch * dims.cp:
            return
        use_metric_group(self.process_group("loss"))
        for metric in self.lightning_module.modules():
            if isinstance(metric, Metric) and metric.process_group is None and metric.dist_sync_fn is None:
                metric.dist_sync_fn = gather_over_data_parallel

    @override
    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        # Evaluation after fitting sets the model up again: drop optimizers that refer to the old parameters.
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @property
    def offloads_parameters(self) -> bool:
        """Whether sharded parameters, gradients and optimizer state live in CPU memory (FSDP2 CPU offload)."""
        return False

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        place_model(self.model, self.root_device, self.offloads_parameters)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # With empty_init the model is created on the meta device and materialized after sharding in setup().
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ steps
    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.transform_batch(batch, dataloader_idx)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # A mid-epoch checkpoint resumes at the next batch, not at the epoch's first (see data_position.py).
        if self._resume_position is not None and self.lightning_module.trainer.state.stage == RunningStage.TRAINING:
            index, self._resume_loader_index = self._resume_loader_index, self._resume_loader_index + 1
            if skip_trained_batches(dataloader, self._resume_position, index, self.parallel_dims.batch):
                warnings.filterwarnings("ignore", message=LIGHTNING_NOT_RESUMABLE_WARNING)
        return dataloader

    @override
    def on_train_start(self) -> None:
        self._resume_position = None  # every training dataloader has been set up by now

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.checkpoint_io.check()  # a background save that failed is raised here, on every rank

    # The step protocol: train_context() spans a training step's forward and backward; run_training_step,
    # run_backward and run_eval_step are where a strategy takes a step over (pipeline: its schedule).
    def train_context(self) -> ExitStack:
        """Contexts that must stay active from a training step's forward to the end of its backward: activation
        checkpointing recomputes forward inside backward (loss parallel's cross-entropy, context parallel's attention
        dispatch). Subclasses add theirs to the stack ``super().train_context()`` returns. (Precision's autocast
        is entered around the forward only, as torch recommends.)"""
        return ExitStack()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._close_train_context()  # the previous step's, if its backward was skipped (training_step gave None)
        self._train_context = self.train_context()
        try:
            with self.precision_plugin.train_step_context():
                return self.run_training_step(*args, **kwargs)
        except BaseException:
            self._close_train_context()
            raise

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        try:
            return self.run_backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._close_train_context()

    def run_backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """The backward of a training step, inside :meth:`train_context`: Lightning's (precision plugin, loss scaling).
        A strategy whose schedule already ran backward (pipeline) overrides this."""
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _close_train_context(self) -> None:
        context, self._train_context = self._train_context, None
        if context is not None:
            context.close()

    def run_eval_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``validation_step``/``test_step``/``predict_step`` through the root module's ``__call__`` (so FSDP's
        root hooks gather its parameters). A strategy that evaluates differently (pipeline) overrides this."""
        return self._forward_redirection(self.model, self.lightning_module, step, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self.run_eval_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self.run_eval_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self.run_eval_step("predict_step", *args, **kwargs)

    @property
    def accumulation_sync_mode(self) -> AccumulationSync:
        """When gradients are communicated during gradient accumulation (see :mod:`.parallel.gradient_sync`)."""
        return "every"

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this around every micro-batch but the last of an accumulation window.
        assert self.model is not None
        with deferred_gradient_sync(self.model, self.accumulation_sync_mode):
            yield

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        # The closure runs forward/backward; gathered parameters must not outlive it into the update.
        def closure_then_reshard() -> Any:
            result = closure()
            reshard_all(self.model)
            if self._tp_replicated:  # before clipping and the update: the copies must see identical gradients
                average_gradients(self._tp_replicated, self.process_group("tp"))
            return result

        return super().optimizer_step(optimizer, closure_then_reshard, model, **kwargs)

    def _reshard_after_evaluation(self) -> None:
        if self.model is not None:
            reshard_all(self.model)

    @override
    def on_validation_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_test_end(self) -> None:
        self._reshard_after_evaluation()

    @override
    def on_predict_end(self) -> None:
        self._reshard_after_evaluation()

    # ------------------------------------------------------------------ collectives
    def process_group(self, name: str = "loss") -> dist.ProcessGroup:
        """The process group of a mesh axis or derived group (``"batch"``, ``"fsdp"``, ``"loss"``, ``"tp"``...)."""
        return self.mesh[name].get_group()

    @override
    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not dist.is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over ``group``; by default over the ``loss`` group, so TP/PP peers are not counted twice.

        A DTensor (``self.log("w", param.norm(), sync_dist=True)`` on a sharded parameter) is first made whole, so the
        value is the one DDP logs.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if group is None and self._mesh is not None:
            dims = self.parallel_dims
            if dims.pp > 1:
                tensor = self._from_loss_stage(tensor)
            if dims.batch * dims.cp == 1:
                return tensor  # a one-rank loss group (tensor/pipeline peers only): every rank holds the value now
            group = self.process_group("loss")
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @property
    def loss_stage(self) -> int:
        """The pipeline stage whose ranks hold the true loss and logged values (the last); the others' are
        placeholders, replaced by :meth:`reduce` with the loss stage's before they are averaged."""
        return self.parallel_dims.pp - 1

    def _from_loss_stage(self, tensor: Tensor) -> Tensor:
        value = tensor.detach().clone().contiguous()
        dist.broadcast(value, group=self.process_group("pp"), group_src=self.loss_stage)
        return value

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over ``group``; by default over the ``loss`` group (one value per data-parallel replica). DTensors
        are gathered by their full values."""
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if group is None and self._mesh is not None:
            group = self.process_group("loss")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank of the job takes the same decision (early stopping, checkpointing): reduce over all ranks."""
        if not dist.is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = _sync_ddp_if_available(flag, dist.group.WORLD, reduce_op=ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def checkpoint_io(self) -> ParallelCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = DistributedCheckpointIO()
        return self._checkpoint_io  # type: ignore[return-value]

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        if io is not None and not isinstance(io, ParallelCheckpointIO):
            raise TypeError(
                f"{type(self).__name__} cannot save through {type(io).__name__}: each rank holds only its shards of"
                " the model. Use lightning_dist.DistributedCheckpointIO (the default, sharded),"
                " lightning_dist.AsyncDistributedCheckpointIO (sharded, saved in the background) or"
                " lightning_dist.FullStateCheckpointIO (one consolidated file)."
            )
        self._checkpoint_io = io

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return states.model_state(self.model, full=self.checkpoint_io.full_state)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return states.optimizer_state(self.model, optimizer, full=self.checkpoint_io.full_state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(str(filepath)))
        checkpoint[PROVENANCE_KEY] = self._checkpoint_provenance()
        trainer = self.lightning_module.trainer
        if trainer.state.fn == TrainerFn.FITTING:
            checkpoint[PROVENANCE_KEY]["data_position"] = training_position(trainer, self.parallel_dims.batch)
        self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def _checkpoint_provenance(self) -> dict[str, Any]:
        from lightning_dist import __version__

        return {
            "strategy": type(self).__name__,
            "world_size": self.world_size,
            "mesh": self.parallel_dims.as_dict(),
            "format": "full" if self.checkpoint_io.full_state else "sharded",
            "version": __version__,
        }

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded folder or a single-file checkpoint, whichever ``checkpoint_path`` is, saved with any number
        of ranks and any lightning_dist strategy (or a one-device Lightning run)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        self.checkpoint_io.wait()
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = (
            [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers] if fitting else []
        )
        metadata = states.load_checkpoint_into(path, self.model, optimizers, strict)
        self._resume_position = metadata.get(PROVENANCE_KEY, {}).get("data_position") if fitting else None
        self._resume_loader_index = 0
        return metadata

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint()

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint()

    # ------------------------------------------------------------------ teardown and logging
    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self._close_train_context()
        try:
            self.checkpoint_io.teardown()  # first: a save still in flight is awaited, and its failure raised
        finally:
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()

    def log_decision(self, message: str) -> None:
        """One rank-zero INFO line per decision the strategy makes."""
        rank_zero_info(f"{self.log_name}: {message}")


@functools.cache
def _destroy_process_groups_at_exit() -> None:
    """Destroy every process group when the interpreter exits (registered once per process).

    Groups left alive at exit are torn down by C++ destructors while their worker threads may still be joinable,
    which can abort an otherwise finished run ("terminate called without an active exception", a non-zero exit code
    that schedulers read as a failed job). Teardown keeps them alive on purpose: ``fit`` then ``test`` on one Trainer
    reuses the mesh. Background checkpoint writers are joined in ``teardown`` before this runs.
    """

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    atexit.register(destroy)
