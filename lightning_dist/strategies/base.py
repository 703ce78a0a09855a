"""The shared base of every lightning_dist strategy: how the Trainer reaches :mod:`lightning_dist.parallel`.

A concrete strategy says which mesh it wants (:meth:`MeshParallelStrategy.mesh_sizes`), what it can check before
launch (:meth:`~MeshParallelStrategy.check_model`) and how to parallelize the model on the mesh
(:meth:`~MeshParallelStrategy.parallelize`, usually one call of :func:`lightning_dist.parallel.parallelize`). The base
owns the rest: processes (gloo on CPU, NCCL on CUDA; none spawned when torchrun or SLURM started them), the checks of
:mod:`.lifecycle.preflight` before launch, the N-D mesh, the sampler's view of data parallelism, precision-plugin
conversion, meta-device materialization and placement after sharding, equal replicated copies, and global-norm
clipping (in the precision plugin). Mixins of :mod:`.lifecycle` hold the rest, one job each:
:class:`~.lifecycle.parallelize_options.ParallelizeOptions` (the options every strategy shares, as a parallelize
config, and the log of what it did), :class:`~.lifecycle.processes.ProcessSetup` (devices, the launcher, the process
group and the mesh, teardown), :class:`~.lifecycle.model_setup.ModelSetup` (checks before launch, the model's
set-up), :class:`~.lifecycle.float8.Float8Setup` (FP8 training), :class:`~.lifecycle.initial_weights.InitialWeightsSetup` (pretrained weights
loaded after sharding), :class:`~.lifecycle.weight_averaging.
WeightAveragingSetup` (Lightning's EMA and SWA callbacks on shards), :class:`~.lifecycle.step_protocol.StepProtocol`
(training, evaluation and optimizer steps, composed of the parts the parallelisms of :mod:`.parallelisms` declare),
:class:`~.lifecycle.collectives.MeshCollectives` (reductions over the right mesh group) and
:class:`~.lifecycle.checkpointing.ShardedCheckpointing` (saving and loading). The base imports no parallelism.

Model parts: :attr:`MeshParallelStrategy.model_parts` are the modules this rank runs, one for every strategy but
the pipeline, which has one per stage held on this rank. A pipeline cuts its stages out of the LightningModule in
place: modules of other stages are replaced by parameterless placeholders, so the LightningModule holds exactly
the local parameters under their original names. ``configure_optimizers`` (``self.parameters()``), state dicts
and checkpoints therefore see this rank's parameters only, and the parts share their modules with it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module

from lightning_dist.parallel.activation_checkpointing import ActivationCheckpointing, check_activation_checkpointing
from lightning_dist.parallel.compile import resolve_compile_options
from lightning_dist.parallel.float8 import Float8Recipe, check_float8_recipe, check_float8_skip
from lightning_dist.parallel.fsdp_options import (
    check_reshard_after_forward,
    check_reshard_after_forward_mesh,
)
from lightning_dist.parallel.gradient_sync import (
    AccumulationSync,
    check_accumulation_sync,
    check_accumulation_sync_mesh,
)
from lightning_dist.parallel.mesh import AXIS_OPTIONS, ParallelDims, ParallelMesh
from lightning_dist.parallel.module_selection import check_unit_choice
from lightning_dist.plugins.precision import FSDP2Precision, to_fsdp2_precision
from lightning_dist.strategies.lifecycle.checkpointing import ShardedCheckpointing
from lightning_dist.strategies.lifecycle.collectives import MeshCollectives
from lightning_dist.strategies.lifecycle.float8 import Float8Setup
from lightning_dist.strategies.lifecycle.initial_weights import InitialWeightsSetup, check_initial_weights
from lightning_dist.strategies.lifecycle.model_setup import ModelSetup
from lightning_dist.strategies.lifecycle.nonfinite_guard import NonFiniteMode
from lightning_dist.strategies.lifecycle.parallelize_options import ParallelizeOptions
from lightning_dist.strategies.lifecycle.preflight import strategy_options, unknown_options_message
from lightning_dist.strategies.lifecycle.processes import ProcessSetup
from lightning_dist.strategies.lifecycle.step_protocol import StepProtocol
from lightning_dist.strategies.lifecycle.weight_averaging import WeightAveragingSetup

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_dist.parallel.runtime.watchdog import FailureWatchdog

MeshSize = int | Literal["auto"]


class MeshParallelStrategy(
    ParallelizeOptions,
    InitialWeightsSetup,
    Float8Setup,
    WeightAveragingSetup,
    ShardedCheckpointing,
    MeshCollectives,
    StepProtocol,
    ModelSetup,
    ProcessSetup,
    ParallelStrategy,
):
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
            :class:`~lightning_dist.parallel.runtime.nonfinite.NonFiniteError` on every rank, ``"ignore"`` (default) checks
            only the first training step's loss. The check costs one gradient norm pass and a tiny all-gather per
            optimizer step. Whatever the setting, a first training loss that is not finite is reported: a warning
            naming the step (``"stop"``: the error).
        compile: ``torch.compile`` the model's repeated blocks in place after tensor parallelism and activation
            checkpointing, before FSDP2 shards them (torchtitan's order; names and checkpoint keys do not change).
            ``False``, ``True`` (torch.compile's defaults) or a dict of ``torch.compile`` keyword arguments
            such as ``{"mode": "max-autotune-no-cudagraphs"}``; ``None`` (default): off, except with ``float8`` on
            CUDA (FP8 is only fast compiled). A submodule the user wrapped in ``torch.compile(...)`` is unwrapped
            first and compiled in place with the user's settings. Resolved in :attr:`compile_options`.
        reshard_after_forward: Whether FSDP2 frees a unit's gathered parameters after forward (and all-gathers them
            again in backward): ``True``, ``False``, or an int ``k`` that keeps a 1/k slice after forward so backward
            gathers stay within groups of k ranks. ``None`` (default): on (for ``fsdp2``, what ``sharding``
            implies), except off under a pipeline (``pp > 1``), where every micro-batch would gather again.
        wrap_modules: Module classes to shard (and checkpoint, and compile) as units instead of the detected
            blocks: classes in Python, class-path strings (``"my_pkg.model.Block"``) or bare class names in YAML;
            under a pipeline each stage takes the ones it holds.
        wrap_regex: A regex over qualified module names (``"layers\\.\\d+"``) selecting the units, alone or in
            addition to ``wrap_modules`` (names below the pipelined module under a pipeline).
        activation_checkpointing: Recompute activations in backward instead of keeping them: ``True`` every unit
            the strategy shards (the repeated blocks), an int k every k-th unit, ``"selective"`` every unit keeping
            the outputs of its matmuls and attention (recomputing norms, activations and the like), or a list of
            module classes (or class names) whose every module is checkpointed, as Lightning's
            ``activation_checkpointing_policy``.
        accumulation_sync: With ``accumulate_grad_batches=k``: ``"every"`` reduces gradients after each micro-batch
            (sharded gradient memory, k reduce-scatters per step); ``"last"`` only after the last (1/k of the bytes,
            full unsharded gradients held in between, as in DDP); ``"replicas_last"`` (with ``dp_replicate``, HSDP)
            reduce-scatters every micro-batch but all-reduces across replica groups only after the last. Only
            ``"every"`` under a pipeline (its schedule decides).
        float8: FP8 training through torchao (``pip install 'lightning-dist[fp8]'``): ``"rowwise"``,
            ``"tensorwise"`` (FP8 weight all-gather under FSDP2) or ``"mxfp8"`` (B200); ``None`` (default): off.
            Converts every ``nn.Linear`` whose dims are multiples of 16 (32 for mxfp8), except the output head,
            before any parallelism; weights and optimizer state stay in the base precision. Emulated on the CPU
            (numerics only). See docs/float8.md.
        float8_skip: Linear layers left out of ``float8``: a qualified module name or a regex matched against the
            whole name (``"blocks\\.0\\..*"``), or a list of them.
        initial_weights: Pretrained weights to start from: a Hugging Face model folder (``*.safetensors`` shards with
            their ``model.safetensors.index.json``) or one ``*.safetensors`` file. Read after the model is sharded,
            each rank reading only the slices it holds; build the model under ``trainer.init_module(empty_init=True)``
            so that no rank ever holds it whole. Not read when resuming (``ckpt_path``). See docs/pretrained.md.
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
        compile: bool | dict[str, Any] | None = None,
        reshard_after_forward: bool | int | None = None,
        wrap_modules: list[type[Module] | str] | set[type[Module]] | None = None,
        wrap_regex: str | None = None,
        activation_checkpointing: ActivationCheckpointing = False,
        accumulation_sync: AccumulationSync = "every",
        float8: Float8Recipe | None = None,
        float8_skip: list[str] | str | None = None,
        initial_weights: str | None = None,
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
        self.compile_set = compile is not None  # else float8 on CUDA turns it on
        self.float8 = check_float8_recipe(float8)
        self.float8_skip = check_float8_skip(float8_skip)
        self.initial_weights = check_initial_weights(initial_weights)
        # The FSDP-family options: every strategy shards with FSDP2 wherever its mesh has data-parallel ranks.
        self.reshard_after_forward = check_reshard_after_forward(reshard_after_forward)
        self.wrap_modules, self.wrap_regex = check_unit_choice(wrap_modules, wrap_regex)
        self.activation_checkpointing = check_activation_checkpointing(activation_checkpointing)
        self.accumulation_sync = check_accumulation_sync(accumulation_sync)
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
        self._root_parameters: dict[str, torch.nn.Parameter] = {}
        self._watchdog: FailureWatchdog | None = None
        self._averaging_devices: dict[int, Any] = {}
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
            check_accumulation_sync_mesh(self.accumulation_sync, self._dims)
            check_reshard_after_forward_mesh(self.reshard_after_forward, self._dims)
        return self._dims

    def resolve_mesh_again(self) -> None:
        """Forget the resolved sizes: :attr:`parallel_dims` resolves :meth:`mesh_sizes` again when next read."""
        self._dims = None

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

    # ------------------------------------------------------------------ precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> FSDP2Precision:
        if self._precision_plugin is None:
            self._precision_plugin = FSDP2Precision()
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = to_fsdp2_precision(precision_plugin)

    def log_decision(self, message: str) -> None:
        """One rank-zero INFO line per decision the strategy makes."""
        rank_zero_info(f"{self.log_name}: {message}")
