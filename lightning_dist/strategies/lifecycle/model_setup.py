"""The model's set-up in a lightning_dist strategy (a mixin of the shared base): the checks before launch, then at
setup precision conversion, parallelizing, meta-device materialization and placement, equal replicated copies,
metrics synced over the right group, optimizers; and where a resumed epoch starts."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from typing_extensions import override

from lightning_dist.compat.hugging_face import generation_cache_configs
from lightning_dist.compat.lightning import optimizers_to_device, reset_optimizers_and_schedulers
from lightning_dist.parallel.compile import keep_user_compilation, unwrap_user_compiled
from lightning_dist.parallel.expert_parallel import mark_held_experts
from lightning_dist.parallel.expert_parallel.router_loss import reduce_router_statistics
from lightning_dist.parallel.fsdp import is_fully_sharded, root_parameters
from lightning_dist.parallel.materialize import (
    Materialized,
    materialize,
    never_initialized_buffers,
    never_initialized_message,
    on_every_rank,
    uninitialized_message,
)
from lightning_dist.parallel.placement import place_model
from lightning_dist.parallel.replicated_state import broadcast_replicated_state
from lightning_dist.strategies.lifecycle.data_position import LIGHTNING_NOT_RESUMABLE_WARNING, skip_trained_batches
from lightning_dist.strategies.lifecycle.finetuning_callbacks import compare_mixed_parameters
from lightning_dist.strategies.lifecycle.interrupted_saves import recover_checkpoint_folders
from lightning_dist.strategies.lifecycle.metric_sync import gather_over_data_parallel, use_metric_group
from lightning_dist.strategies.lifecycle.model_handover import parallelize_or_adopt
from lightning_dist.strategies.lifecycle.preflight import (
    PARALLELIZED,
    check_callbacks,
    check_ckpt_path,
    check_same_parallelism,
    parallel_settings,
)

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object


class ModelSetup(_Base):
    """Checks before launch and the model's set-up of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        parts = self.step_parts()
        for part in parts:  # pipeline: manual optimization refused
            part.before_setup(trainer)
        self.accelerator.setup(trainer)
        parallelize_or_adopt(self, trainer)  # or take over an earlier Trainer's parallelized model
        self._turn_off_generation_cache_in_training(trainer)
        compare_mixed_parameters(trainer)  # BackboneFinetuning over DTensors and plain tensors (tensor parallel)
        self.shard_averaged_copies(trainer)  # WeightAveraging/SWA copied the model before it was parallelized
        self.finish_model_setup()
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
            optimizers_to_device(self.optimizers, self.root_device)  # offloaded optimizer state stays on the CPU
        for part in parts:  # tensor parallel: an earlier Trainer's plan; pipeline: Lightning's backward skipped
            part.after_setup(trainer)

    def prepare_model(self) -> None:
        """Parallelize :attr:`model` as this strategy's options say: precision conversion, a user's compilation
        adopted, float8, :meth:`parallelize`, meta-device materialization, placement, ``initial_weights`` and equal
        replicated copies. The Trainer's set-up and a Fabric strategy (:mod:`lightning_dist.fabric`) both call it."""
        assert self.model is not None
        self.model = self.precision_plugin.convert_module(self.model)
        self._adopt_user_compiled(self.model)
        self.convert_float8(self.model)  # before any parallelism (torchtitan's order)
        self.model = self.parallelize(self.model)
        object.__setattr__(self.model, PARALLELIZED, parallel_settings(self))
        # Meta-initialized (empty_init) state is created where it will live: the CPU under offload.
        device = torch.device("cpu") if self.offloads_parameters else self.root_device
        self._report_materialized(materialize(self.model, device, self.global_rank), device)
        self.model_to_device()
        mark_held_experts(self.model)  # materializing and moving made new parameter objects, without marks
        self.load_initial_weights()  # each rank its own slices, into the sharded, materialized model
        self._make_replicas_equal()

    def finish_model_setup(self) -> None:
        """After :meth:`prepare_model` (or on a model an earlier run prepared): autocast where no FSDP2 policy casts,
        MoE router statistics over the batch, each step part's view of the parameters, and the clipping group."""
        assert self.model is not None
        if not is_fully_sharded(self.model):  # no FSDP2 policy to cast parameters: mixed precision is autocast
            self.precision_plugin.use_autocast(self.root_device.type)
        self._reduce_router_statistics()
        for part in self.step_parts():  # tensor parallel: the parameters whose gradients are made consistent over tp
            part.after_parallelize()
        self._root_parameters = root_parameters(self.model)  # manual optimization: see run_manual_backward
        # Each pipeline stage holds different parameters: the norm to clip by sums over the stages.
        self.precision_plugin.stage_group = self.process_group("pp") if self.parallel_dims.pp > 1 else None

    def _report_materialized(self, materialized: Materialized | None, device: torch.device) -> None:
        """What materializing a meta-device model (``Trainer.init_module(empty_init=True)``) initialized, agreed on
        every rank (each checked its own shards and stages): a log line; non-persistent buffers nothing initialized
        are refused (no checkpoint holds them), parameters nothing initialized are warned about."""
        if materialized is None:
            return
        agreed = on_every_rank(materialized)
        if agreed.lost_buffers:
            raise RuntimeError(never_initialized_message(agreed.lost_buffers, agreed.classes))
        if agreed.uninitialized:
            rank_zero_warn(uninitialized_message(agreed.uninitialized, agreed.classes), category=UserWarning)
        how = f"reset_parameters() of {materialized.reset_modules} modules"
        if materialized.pretrained:
            how += f", then the own weight init of {', '.join(materialized.pretrained)} (transformers)"
        draws = "; random draws seeded per rank (the current seed + rank)" if device.type == "cpu" else ""
        self.log_decision(f"materialized the meta-device model on {device.type}: {how}{draws}")

    def _turn_off_generation_cache_in_training(self, trainer: pl.Trainer) -> None:
        """Hugging Face models keep a key/value cache (``use_cache=True`` by default) that only generation reads:
        under ``compile`` it doubled what each block traces (118 operations in 2 graphs, against 55 in 1) and cost
        17% of the tokens/s on one H200. transformers' Trainer, TRL and torchtitan turn it off for training; so does
        every step of :meth:`train_context` here, leaving evaluation and prediction with the user's setting."""
        assert self.model is not None
        self._generation_caches = tuple(generation_cache_configs(self.model))
        if self._generation_caches and trainer.state.fn == TrainerFn.FITTING:
            names = ", ".join(sorted({type(config).__name__ for config in self._generation_caches}))
            self.log_decision(
                f"key/value cache off in training steps (use_cache=False on {names} while a training step runs, as"
                " transformers' Trainer does); validation, test and predict keep use_cache=True"
            )

    def _reduce_router_statistics(self) -> None:
        """A transformers MoE model's auxiliary load-balancing loss from the routing of the whole batch, as one
        process computes it: each data-parallel (and context-parallel) rank routes part of the tokens, and the loss
        is a product of means, so per-rank losses averaged are not the batch's (6e-5 off on a tiny Mixtral)."""
        if not dist.is_initialized() or self.mesh["loss"].size() == 1:
            return
        patched = reduce_router_statistics(self.model, self.process_group("loss"))
        if patched and not getattr(self, "_router_statistics_logged", False):
            self._router_statistics_logged = True
            self.log_decision(
                f"router auxiliary loss ({', '.join(patched)}): from the routing statistics of all"
                f" {self.mesh['loss'].size()} ranks that share the batch"
            )

    # ------------------------------------------------------------------ checks before launch
    def preflight(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        """Everything that can be checked before processes are launched (see :mod:`.preflight`): the checkpoint
        callbacks, ``ckpt_path``, the float8 option, weight-averaging callbacks that would copy a model already
        sharded, a model an earlier Trainer already parallelized, and the model against the strategy's options
        (:meth:`check_model`); around them, each step part's checks of the first batch, in the launching process
        (context parallel before the model's checks, the pipeline after them). ``arguments`` are those of the
        Trainer entry point."""
        launching = self.mesh_is_known() and not self.cluster_environment.creates_processes_externally
        parts = self.step_parts() if launching else []
        for part in parts:
            part.preflight_before_model(trainer, arguments)
        check_callbacks(trainer)
        recover_checkpoint_folders(trainer, self.global_rank, arguments.get("ckpt_path"))
        self._requested_weights_only = arguments.get("weights_only")
        check_ckpt_path(arguments.get("ckpt_path"), self._requested_weights_only)
        self.check_float8(trainer)
        self.check_averaging_callbacks(trainer)
        model = self.lightning_module
        if model is not None:
            self._adopt_user_compiled(model)  # compiled before fit: checked (and named) without `_orig_mod.`
            applied = getattr(model, PARALLELIZED, None)
            if applied is not None:
                check_same_parallelism(self, applied)
            elif not is_overridden("configure_model", model, pl.LightningModule):
                if never_initialized := never_initialized_buffers(model):
                    raise RuntimeError(never_initialized_message(sorted(never_initialized), never_initialized))
                self.check_model(model)
        unbuilt = (
            model is None
            or getattr(model, PARALLELIZED, None) is not None
            or is_overridden("configure_model", model, pl.LightningModule)
        )
        self.check_initial_weights_before_launch(None if unbuilt else model, trainer, arguments.get("ckpt_path"))
        for part in parts:
            part.preflight_after_model(trainer, arguments)

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
        for part in self.step_parts():  # pipeline: the copies of a weight tied across stages
            part.make_copies_equal()

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
        reset_optimizers_and_schedulers(self)
        setup = functools.partial(super().setup_optimizers, trainer)
        for part in reversed(self.step_parts()):  # pipeline: a stage with nothing to optimize
            setup = part.wrap_optimizer_setup(setup)
        setup()

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
            replicas = self.distributed_sampler_kwargs["num_replicas"]
            if skip_trained_batches(dataloader, self._resume_position, index, replicas):
                warnings.filterwarnings("ignore", message=LIGHTNING_NOT_RESUMABLE_WARNING)
        return dataloader

    @override
    def on_train_start(self) -> None:
        self._resume_position = None  # every training dataloader has been set up by now
        self._first_loss_checked = False  # the first step of each fit has its loss checked

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.checkpoint_io.check()  # a background save that failed is raised here, on every rank
        for part in self.step_parts():
            part.before_training_batch(self.lightning_module.trainer)
