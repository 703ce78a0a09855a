"""The pipeline half of a strategy's set-up (a mixin before the shared base): options, the stage cut of an
unchanged model, tied weights across stages, and what changes in Lightning's loop when a schedule runs backward.
Used by ``pipeline`` and ``hybrid3d``; inactive on a mesh whose ``pp`` axis has one rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.nn import Module
from typing_extensions import override

from lightning_dist.compat.hugging_face import router_loss_requested
from lightning_dist.compat.lightning import skip_lightning_backward
from lightning_dist.parallel import pipeline as pp
from lightning_dist.parallel.expert_parallel.router_loss import reduce_router_statistics
from lightning_dist.parallel.pipeline.router_statistics import carry_router_statistics, plan_router_statistics
from lightning_dist.parallel.runtime.random_state import rng_kept
from lightning_dist.strategies.lifecycle.first_batch import first_batch
from lightning_dist.strategies.lifecycle.preflight import PARALLELIZED
from lightning_dist.strategies.parallelisms.pipeline.logs import captured_log

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object

Split = str | list[str] | list[list[str]]


class PipelineStages(_Base):
    """Stage cutting and set-up of a pipeline strategy, when ``pp > 1``."""

    #: What the cut sets, taken over by a later Trainer's strategy with the model (see ``lifecycle/model_handover``).
    parallelized_state = ("_module", "_module_prefix", "_plan", "_ties", "_tie_groups", "_stage_ids", "_model_parts")

    def init_pipeline(
        self, schedule: str, n_microbatches: int | None, stages_per_rank: int | None, split: Split
    ) -> None:
        """Check and keep the pipeline options (called from the strategy's ``__init__``)."""
        self.schedule = pp.schedule_name(schedule)  # any spelling torch or torchtitan uses; refuses an unknown one
        self.info = pp.SCHEDULES[self.schedule]
        self.stages_per_rank = pp.resolve_stages_per_rank(self.schedule, stages_per_rank)
        if n_microbatches is not None:
            pp.check_n_microbatches(n_microbatches)
        self.n_microbatches = n_microbatches
        self.split = split
        self._runners: dict[int, pp.PipelineRunner] = {}
        self._ties: list[pp.TiedParameter] = []
        self._tie_groups: list[Any] = []
        self._tie_layouts_agree: list[bool] | None = None  # per tie, once parallelized (see pp.tied_layouts_agree)
        self._step_fn: Any = None  # what the runners' loss_fn runs on the last stage, per micro-batch
        self._module: Module | None = None  # the module whose one call the steps make, pipelined

    @property
    def pipelined(self) -> bool:
        return self.parallel_dims.pp > 1

    @property
    def pipelined_module(self) -> Module | None:
        """The module whose one call the steps make, pipelined (once the stages are cut)."""
        return self._module

    @property
    def stage_plan(self) -> pp.StagePlan:
        """Where the stages begin and what each holds (once the stages are cut)."""
        return self._plan

    @property
    def stage_ids(self) -> list[int]:
        """The stages this rank holds, in order (once the stages are cut)."""
        return self._stage_ids

    @property
    @override
    def loss_stage(self) -> int:
        return 0 if self.info.placement == "v" else self.parallel_dims.pp - 1  # V: rank 0 holds the last stage

    def microbatches_for(self, batch_size: int, training: bool = True) -> int:
        """The number of micro-batches for a per-replica batch of ``batch_size`` (refuses an invalid setting), by one
        rule (:func:`~lightning_dist.parallel.pipeline.resolve_n_microbatches`) for training, under the schedule,
        and evaluation, under the forward-only pass's rule with one stage per rank."""
        p, v = self.parallel_dims.pp, self.stages_per_rank
        if training:
            return pp.resolve_n_microbatches(self.schedule, batch_size, self.n_microbatches, p, v)
        return pp.resolve_n_microbatches(pp.FORWARD_ONLY_RULE, batch_size, self.n_microbatches, p, 1)

    def check_pipeline_model(self, model: Module, inputs: dict[str, Any] | None = None) -> pp.StagePlan:
        """Before launch: plan the stages of ``model`` (refusing too few blocks, an encoder–decoder model, a split
        naming unknown modules) and rehearse their forwards on a meta-device copy (see
        :func:`~lightning_dist.parallel.pipeline.rehearse_stages`; ``inputs``: the pipelined call's arguments on the
        first batch, default example token ids), refusing what the cut cannot run."""
        module = model.get_submodule(pp.find_pipelined_module(model))
        if (owner := router_loss_requested(module)) is not None and plan_router_statistics(module) is None:
            raise ValueError(
                f"{owner} computes the router's auxiliary loss (output_router_logits=True) from the routing of every"
                " MoE layer together, and a pipeline stage sees only its own layers. lightning_dist sends each"
                " stage's routing statistics on to the last stage for transformers MoE models whose router logits,"
                " experts and top-k it can find, and found them incomplete here. Set output_router_logits=False to"
                f" train it with pipeline_parallel_size={self.parallel_dims.pp}, or keep the auxiliary loss without"
                " pipeline stages (fsdp2, or hybrid3d without pp)."
            )
        plan = pp.plan_stages(module, self.parallel_dims.pp * self.stages_per_rank, self.split)
        pp.rehearse_stages(module, plan, inputs)
        self.chosen_stage_units(module)
        return plan

    def chosen_stage_units(self, module: Module) -> dict[str, Module] | None:
        """The modules of the pipelined ``module`` that ``wrap_modules``/``wrap_regex`` choose as units, by name
        (a ``ValueError`` when they choose nothing); ``None`` for the detected blocks."""
        if self.wrap_modules is None and self.wrap_regex is None:
            return None
        return dict(self.shard_units(module))

    def check_first_training_batch(self, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
        """Before ``fit`` launches, the first training batch when it can be read here (see
        :func:`~..lifecycle.first_batch.first_batch`): micro-batches that must divide its size, and the
        stage rehearsal on its real inputs (images, say, where example token ids do not fit the forward). Only the
        launching process reads it; ranks created elsewhere (torchrun, SLURM) meet the same checks on their first
        batch, before the step's first collective."""
        model = self.lightning_module
        launching = self.reads_data_before_launch
        if not (launching and self.mesh_is_known() and self.pipelined and trainer.state.fn == TrainerFn.FITTING):
            return
        if model is None or getattr(model, PARALLELIZED, None) is not None:
            return
        if is_overridden("configure_model", model, pl.LightningModule):
            return
        inputs = _first_training_call(model, arguments)
        if inputs is not None:
            self.microbatches_for(max(t.shape[0] for t in inputs.values() if isinstance(t, Tensor) and t.dim() > 0))
            self.check_pipeline_model(model, inputs)

    def cut_stages(self, model: Module) -> list[tuple[Module, list[tuple[str, Module]]]]:
        """Cut this rank's stages out of ``model`` in place (see :mod:`lightning_dist.parallel.pipeline`): each
        stage module with its local blocks (to parallelize next), in stage order. Logs the split."""
        dims, v = self.parallel_dims, self.stages_per_rank
        where = pp.find_pipelined_module(model)
        self._module = model.get_submodule(where)
        self._module_prefix = f"{where}." if where else ""
        chosen = self.chosen_stage_units(self._module)  # before the cut replaces other stages' modules
        plan = pp.plan_stages(self._module, dims.pp * v, self.split)
        self._plan = plan
        self._ties = pp.find_tied_parameters(self._module, plan)
        ranks = self.mesh.world.mesh.movedim(0, -1).reshape(-1, dims.pp).tolist()  # every pipeline group
        self._tie_groups = pp.new_tie_groups(self._ties, ranks, v, self.info.placement)
        self._stage_ids = pp.stage_ids_for_rank(self.mesh["pp"].get_local_rank(), dims.pp, v, self.info.placement)
        statistics = plan_router_statistics(self._module)  # before the cut: every MoE layer is still there
        parts = pp.cut_pipeline_stages(self._module, plan, self._stage_ids, self.root_device)
        if statistics is not None:
            carry_router_statistics(parts, statistics)
            reduce_router_statistics(self._module, self.process_group("loss"))
            self.log_decision(
                "router auxiliary loss: each stage sends its routing statistics (counts, probability sums and rows"
                f" of {statistics.num_experts} experts) on with the activation; the last stage's loss sums every"
                " stage's, per micro-batch"
            )
        stages = []
        for part, stage in zip(parts, self._stage_ids):
            local = set(plan.stages[stage]) & set(plan.blocks)  # not the stand-ins of other stages' blocks
            if chosen is not None:  # the chosen modules this stage holds (not another stage's stand-ins)
                stages.append((part, [(n, m) for n, m in part.named_modules() if chosen.get(n) is m]))
            else:
                stages.append((part, [(n, m) for n, m in part.named_modules() if n in local]))
        if where:
            self.log_decision(f"pipelining {where} ({type(self._module).__name__}), the module holding every parameter")
        self.log_decision(
            f"schedule {self.schedule}, {v} stage(s) per rank over pp={dims.pp}, placement {self.info.placement}"
        )
        for line in plan.describe():
            self.log_decision(line)
        for tie in self._ties:
            self.log_decision(f"tied across stages, gradients summed: {tie.describe()}")
        return stages

    def tied_weight_aliases(self) -> dict[str, tuple[str, ...]]:
        """Each name (in the LightningModule) of a weight tied across stages → its other names (each stage holds a
        copy under its own)."""
        prefix = getattr(self, "_module_prefix", "")
        return {
            prefix + name: tuple(prefix + other for other in tie.names if other != name)
            for tie in self._ties
            for name in tie.names
        }

    def equalize_tied_copies(self) -> None:
        """At setup: the copies of a weight tied across stages made equal (and counted once by clipping's norm)."""
        if self.pipelined:
            self._tie_layouts_agree = pp.tied_layouts_agree(self._module, self._ties, self._tie_groups)
            for tie, agree in zip(self._ties, self._tie_layouts_agree):
                if not agree:
                    self.log_decision(f"tied copies laid out differently, whole gradients summed: {tie.describe()}")
            pp.broadcast_tied_parameters(self._module, self._ties, self._tie_groups, self._tie_layouts_agree)
            pp.count_tied_copies_once(self._module, self._ties)  # clipping's norm: as one process counts it

    def refuse_manual_optimization(self) -> None:
        """Before launch (and at setup on ranks that torchrun or SLURM started): a module with
        ``automatic_optimization=False`` is refused."""
        model = self.lightning_module
        if self.pipelined and model is not None and not model.automatic_optimization:
            raise ValueError(
                f"{type(model).__name__} sets automatic_optimization=False (manual optimization), which"
                f" {type(self).__name__} cannot run with pipeline_parallel_size={self.parallel_dims.pp}: the pipeline"
                " schedule runs the forward and backward of every micro-batch itself, so a training_step that calls"
                " manual_backward() and optimizer.step() has no place in it. Return the loss from training_step"
                " (automatic optimization), or train this module without pipeline stages (fsdp2, tensor_parallel,"
                " or hybrid3d with pipeline_parallel_size=1)."
            )

    def setup_stage_optimizers(self, setup: Callable[[], None]) -> None:
        """Lightning's optimizer set-up (``setup``: ``configure_optimizers``) on a stage that may hold none of the
        parameters it optimizes (see :mod:`lightning_dist.parallel.pipeline.stage_optimizers`): such an optimizer
        steps nothing, and the stages with nothing to optimize are logged (refused if no stage has any)."""
        with pp.optimizers_may_be_empty() as empty:
            setup()
        optimization = pp.stages_to_optimize(self._stage_ids, self.optimizers, empty, self.process_group("pp"))
        if optimization.idle_stages:
            self.log_decision(optimization.describe())

    def let_the_schedule_run_backward(self, trainer: pl.Trainer) -> None:
        """At the end of setup, and before each training batch."""
        if self.pipelined:
            # The schedule runs backward: Lightning's closure must neither zero the gradients nor call backward.
            skip_lightning_backward(trainer.fit_loop.epoch_loop.automatic_optimization, True)


def _first_training_call(model: pl.LightningModule, arguments: dict[str, Any]) -> dict[str, Any] | None:
    """The keyword arguments of the pipelined call that ``training_step`` makes on the first batch, read before launch
    (the step runs up to that call, logging nothing, random state kept); ``None`` when that cannot be done here."""
    batch = first_batch(arguments, "fit")
    if batch is None:
        return None
    module = model.get_submodule(pp.find_pipelined_module(model))
    try:
        with rng_kept(), captured_log(model, None):
            batch = model.on_after_batch_transfer(model.on_before_batch_transfer(batch, 0), 0)
            call = pp.capture_call(module, lambda: model.training_step(batch, 0))
        inputs = pp.model_inputs_as_kwargs(module, *call)
    except Exception:  # noqa: BLE001 (best effort: the step checks the same after launch)
        return None
    return inputs if any(isinstance(t, Tensor) and t.dim() > 0 for t in inputs.values()) else None
