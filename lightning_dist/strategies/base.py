"""The shared base of every lightning_dist strategy: how the Trainer reaches :mod:`lightning_dist.parallel`.

A concrete strategy says which mesh it wants (:meth:`MeshParallelStrategy.mesh_sizes`), what it can check before
launch (:meth:`~MeshParallelStrategy.check_model`) and how to parallelize the model on the mesh
(:meth:`~MeshParallelStrategy.parallelize`, usually one call of :func:`lightning_dist.parallel.parallelize`). The base
owns the rest: processes (gloo on CPU, NCCL on CUDA; none spawned when torchrun or SLURM started them), the checks of
:mod:`.preflight` before launch, the N-D mesh, the sampler's view of data parallelism, precision-plugin conversion,
meta-device materialization and placement after sharding, equal replicated copies, and global-norm clipping (in the
precision plugin). Three mixins hold the rest, one job each: :class:`.step_protocol.StepProtocol` (training,
evaluation and optimizer steps, and where a strategy takes them over), :class:`.collectives.MeshCollectives`
(reductions over the right mesh group) and :class:`.checkpointing.ShardedCheckpointing` (saving and loading).

Model parts: :attr:`MeshParallelStrategy.model_parts` are the modules this rank runs, one for every strategy but
the pipeline, which has one per stage held on this rank. A pipeline cuts its stages out of the LightningModule in
place: modules of other stages are replaced by parameterless placeholders, so the LightningModule holds exactly
the local parameters under their original names. ``configure_optimizers`` (``self.parameters()``), state dicts
and checkpoints therefore see this rank's parameters only, and the parts share their modules with it.
"""

from __future__ import annotations

import atexit
import functools
import warnings
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel.compile import keep_user_compilation, resolve_compile_options, unwrap_user_compiled
from lightning_dist.parallel.fsdp import FSDPConfig, is_fully_sharded
from lightning_dist.parallel.mesh import AXIS_OPTIONS, ParallelDims, ParallelMesh
from lightning_dist.parallel.parallelize import ParallelizeConfig
from lightning_dist.parallel.placement import place_model
from lightning_dist.parallel.process_group_exit import destroy_process_groups
from lightning_dist.parallel.replicated_state import broadcast_replicated_state, tp_replicated_parameters
from lightning_dist.parallel.tensor_parallel import tp_sharded_parameters
from lightning_dist.plugins.precision import FSDP2Precision, to_fsdp2_precision
from lightning_dist.strategies.checkpointing import ShardedCheckpointing
from lightning_dist.strategies.collectives import MeshCollectives
from lightning_dist.strategies.data_position import LIGHTNING_NOT_RESUMABLE_WARNING, skip_trained_batches
from lightning_dist.strategies.failure_handling import (
    explain_exception,
    restart_store_kwargs,
    start_watchdog,
    stop_watchdogs,
)
from lightning_dist.strategies.metric_sync import gather_over_data_parallel, use_metric_group
from lightning_dist.strategies.preflight import (
    PARALLELIZED,
    PreflightLauncher,
    PreflightSubprocessLauncher,
    check_checkpoint_callbacks,
    check_ckpt_path,
    check_same_parallelism,
    parallel_settings,
    strategy_options,
    unknown_options_message,
)
from lightning_dist.strategies.step_protocol import NonFiniteMode, StepProtocol

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_dist.parallel.tensor_parallel import TensorParallelPlan
    from lightning_dist.parallel.watchdog import FailureWatchdog

MeshSize = int | Literal["auto"]


class MeshParallelStrategy(ShardedCheckpointing, MeshCollectives, StepProtocol, ParallelStrategy):
    """Base of all lightning_dist strategies (not registered itself).

    Subclasses take their own options first and pass every other keyword (these) on with ``**kwargs``; jsonargparse
    follows the forwarding, so each of them is also an option in YAML.

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
        on_nonfinite: When a loss or gradient is NaN or infinite on any rank: ``"skip"`` drops that optimizer step
            on every rank (with a warning naming the step and the ranks), ``"stop"`` raises
            :class:`~lightning_dist.parallel.nonfinite.NonFiniteError` on every rank, ``"ignore"`` (default) checks
            nothing. The check costs one gradient norm pass and a tiny all-gather per optimizer step.
        compile: ``torch.compile`` the model's repeated blocks in place after tensor parallelism and activation
            checkpointing, before FSDP2 shards them (torchtitan's order; names and checkpoint keys do not change).
            ``False`` (default), ``True`` (torch.compile's defaults) or a dict of ``torch.compile`` keyword arguments
            such as ``{"mode": "max-autotune-no-cudagraphs"}``. A model the user compiled with
            ``torch.compile(model)`` is unwrapped first and compiled this way. Resolved in :attr:`compile_options`.
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
        on_nonfinite: NonFiniteMode = "ignore",
        compile: bool | dict[str, Any] = False,
        **unknown: Any,
    ) -> None:
        if unknown:  # a misspelt option of the concrete strategy arrives here, forwarded as a keyword
            raise TypeError(unknown_options_message(type(self), unknown))
        if on_nonfinite not in get_args(NonFiniteMode):
            raise ValueError(
                f"on_nonfinite={on_nonfinite!r} is not one of {list(get_args(NonFiniteMode))}: 'skip' skips the"
                " optimizer step on every rank, 'stop' ends training on every rank, 'ignore' checks nothing."
            )
        self.on_nonfinite = on_nonfinite
        #: The ``torch.compile`` keyword arguments of the ``compile`` option, or ``None`` when it is off.
        self.compile_options: dict[str, Any] | None = resolve_compile_options(compile)
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
        self._model_parts: list[Module] | None = None
        self._resume_position: dict[str, Any] | None = None
        self._resume_loader_index = 0
        #: The ``weights_only`` the Trainer entry point was called with: Lightning drops it on its way to a strategy
        #: that restores after setup (``restore_checkpoint_after_setup``), as every one of ours does.
        self._requested_weights_only: bool | None = None
        self._tp_replicated: list[torch.nn.Parameter] = []
        self._tp_sharded: list[torch.nn.Parameter] = []
        self._watchdog: FailureWatchdog | None = None
        self.num_nodes = 1

    # ------------------------------------------------------------------ what a concrete strategy provides
    def mesh_sizes(self) -> dict[str, MeshSize]:
        """Requested sizes of the mesh axes (``pp, dp_replicate, dp_shard, cp, tp``); one may be ``"auto"``."""
        raise NotImplementedError

    def validate_mesh(self, dims: ParallelDims) -> None:
        """Check strategy-specific constraints on the resolved mesh (before any process group is created)."""

    def parallelize(self, model: Module) -> Module:
        """Apply this strategy's parallelism to ``model`` in place (on every rank, after the mesh exists) and return
        it. A pipeline strategy also sets :attr:`model_parts` to the stages it kept on this rank."""
        raise NotImplementedError

    def standard_parallelize_config(
        self,
        units: list[tuple[str, Module]],
        activation_checkpointing: bool,
        tp_plan: TensorParallelPlan | None = None,
        reshard_after_forward: bool = True,
    ) -> ParallelizeConfig:
        """The :class:`~lightning_dist.parallel.parallelize.ParallelizeConfig` most strategies apply: ``units`` as
        the blocks, FSDP2 (HSDP with ``dp_replicate``) wherever the mesh has data-parallel ranks, this strategy's
        precision policies and ``compile`` option."""
        dims = self.parallel_dims
        sharded = dims.fsdp > 1 or dims.dp_replicate > 1
        mp_policy = self.precision_plugin.mp_policy
        return ParallelizeConfig(
            units=units,
            tp_plan=tp_plan,
            activation_checkpointing=activation_checkpointing,
            fsdp=FSDPConfig(reshard_after_forward=reshard_after_forward, mp_policy=mp_policy) if sharded else None,
            root_mp_policy=self.precision_plugin.root_mp_policy if sharded else None,
            compile=self.compile_options,
        )

    def agree_on_mesh(self) -> None:
        """Make every rank use the same mesh sizes, once the process group exists and before the mesh is built.
        Sizes given as options agree by construction: nothing to do here."""

    def mesh_is_known(self) -> bool:
        """Whether the mesh sizes can be resolved now (``mesh="auto"`` needs the model, known only at ``fit``)."""
        return True

    def check_model(self, model: Module) -> None:
        """Check ``model`` against this strategy's options before any process is launched (e.g. that the classes to
        wrap exist, that head counts divide the TP size). Only called for models whose layers all exist already
        (no ``configure_model``) and that no Trainer has parallelized yet."""

    @property
    def model_parts(self) -> list[Module]:
        """The modules this rank runs: the model itself, or a pipeline's stages on this rank (see the module
        docstring for how they relate to the LightningModule)."""
        if self._model_parts is not None:
            return self._model_parts
        return [self.model] if self.model is not None else []

    @model_parts.setter
    def model_parts(self, parts: list[Module]) -> None:
        self._model_parts = list(parts)

    # ------------------------------------------------------------------ mesh
    def _mesh_option_names(self) -> dict[str, str]:
        """The option of this strategy that sets each mesh axis, for messages about the sizes."""
        options = strategy_options(type(self))
        return {axis: next((n for n in names if n in options), names[0]) for axis, names in AXIS_OPTIONS.items()}

    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved mesh sizes. Available once the strategy is connected to a Trainer."""
        if self._dims is None:
            self._dims = ParallelDims.resolve(self.world_size, options=self._mesh_option_names(), **self.mesh_sizes())
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
        if self.num_processes and self.mesh_is_known():
            # The Trainer calls this while it is being constructed: a mesh that cannot fit fails here, before any
            # process is launched, instead of in every launched process.
            self._dims = None
            _ = self.parallel_dims

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()  # also validates the mesh sizes, before any process group exists
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment,
            self._process_group_backend,
            timeout=self._timeout,
            device_id=device_id,
            **restart_store_kwargs(self.cluster_environment, self._timeout),
        )
        _destroy_process_groups_at_exit()
        self._watchdog = start_watchdog(self)
        self.agree_on_mesh()
        dims = self.parallel_dims
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
        if getattr(self.model, PARALLELIZED, None) is None:
            self.model = self.precision_plugin.convert_module(self.model)
            self._adopt_user_compiled(self.model)
            self.model = self.parallelize(self.model)
            object.__setattr__(self.model, PARALLELIZED, parallel_settings(self))
            # Meta-initialized (empty_init) state is created where it will live: the CPU under offload.
            _materialize_distributed_module(
                self.model, torch.device("cpu") if self.offloads_parameters else self.root_device
            )
            self.model_to_device()
            self._make_replicas_equal()
        if not is_fully_sharded(self.model):  # no FSDP2 policy to cast parameters: mixed precision is autocast
            self.precision_plugin.use_autocast(self.root_device.type)
        self._tp_replicated = tp_replicated_parameters(self.model, self.mesh)
        tp_alone = self.parallel_dims.tp > 1 and not is_fully_sharded(self.model)
        self._tp_sharded = tp_sharded_parameters(self.model) if tp_alone else []
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
        self._requested_weights_only = arguments.get("weights_only")
        check_ckpt_path(arguments.get("ckpt_path"), self._requested_weights_only)
        model = self.lightning_module
        if model is None:
            return
        self._adopt_user_compiled(model)  # compiled before fit: checked (and named) without `_orig_mod.`
        applied = getattr(model, PARALLELIZED, None)
        if applied is not None:
            check_same_parallelism(self, applied)
        elif not is_overridden("configure_model", model, pl.LightningModule):
            self.check_model(model)

    def _adopt_user_compiled(self, model: Module) -> None:
        """Take apart ``torch.compile(module)`` wrappers the user put inside the model (``configure_model`` or before
        ``fit``), so that no module name, log line or checkpoint key gains ``_orig_mod.``: with ``compile`` set, the
        wrapped module is compiled our way (per block, before sharding); without it, the user's compilation is kept
        on the same module in place, with a warning that it breaks its graph at every FSDP unit."""
        unwrapped = unwrap_user_compiled(model)
        if not unwrapped:
            return
        names = ", ".join(name for name, _ in unwrapped)
        verb = "was" if len(unwrapped) == 1 else "were"
        if self.compile_options is not None:
            self.log_decision(
                f"{names} {verb} compiled with torch.compile(): unwrapped, compiled per block by compile="
                f"{self.compile_options or True} instead"
            )
            return
        keep_user_compilation(unwrapped)
        rank_zero_warn(
            f"{names} {verb} compiled with torch.compile() before {type(self).__name__} parallelized the model. The"
            " compilation is kept, applied to the same modules in place (names and checkpoint keys get no"
            " '_orig_mod.'). Around FSDP2's units (a whole model compiled in configure_model) it breaks its graph at"
            " every unit and gains little: +5% over no compile on one H100, where compiling each block before"
            " sharding gained +20%. Leave the model uncompiled and pass the strategy compile=True (or a dict of"
            " torch.compile arguments): it then compiles each block before sharding it.",
            category=UserWarning,
        )

    def _make_replicas_equal(self) -> None:
        """Copy every replicated parameter and buffer from the first rank of each axis it is replicated over, as DDP
        does at setup: without a seed each rank initialized its own values."""
        assert self.model is not None
        count, axes = broadcast_replicated_state(self.model, self.mesh)
        if count:
            self.log_decision(f"{count} replicated tensors made equal across {' × '.join(axes)} (from the first rank)")

    def _sync_metrics_over_loss_group(self) -> None:
        """torchmetrics ``Metric`` objects sync over WORLD by default, which counts tensor/pipeline peers (which saw
        the same samples) more than once in sum states: metrics without a group or sync function of their own
        gather over ``loss`` instead."""
        from torchmetrics import Metric

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

    # ------------------------------------------------------------------ teardown and logging
    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None and self.accelerator is not None
        self._close_train_context()
        if self._watchdog is not None:  # a normal end: stop watching, and rank 0 keeps the store until all have
            self._watchdog.stop()
            self._watchdog.finish()
            self._watchdog = None
        try:
            self.checkpoint_io.teardown()  # first: a save still in flight is awaited, and its failure raised
        finally:
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()

    @override
    def on_exception(self, exception: BaseException) -> None:
        explain_exception(self, exception)
        super().on_exception(exception)

    def log_decision(self, message: str) -> None:
        """One rank-zero INFO line per decision the strategy makes."""
        rank_zero_info(f"{self.log_name}: {message}")


@functools.cache
def _destroy_process_groups_at_exit() -> None:
    """Destroy every process group when the interpreter exits (registered once per process).

    Groups still alive when the process exits have their worker threads running through the C++ teardown, which
    can abort a finished run in a rank whose peers exit first ("terminate called without an active exception": a
    non-zero exit code that schedulers read as a failed job). Teardown keeps them alive on purpose: ``fit`` then
    ``test`` on one Trainer reuses the mesh. Background checkpoint writers are joined in ``teardown`` before this runs.
    """

    def release() -> None:
        stop_watchdogs()
        destroy_process_groups()

    atexit.register(release)
