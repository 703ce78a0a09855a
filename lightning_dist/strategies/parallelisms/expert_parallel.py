"""Expert parallelism in a strategy: :class:`ExpertParallelOption`, the ``expert_parallel_size`` option shared by the
strategies that carry it (fsdp2 and its ``expert_parallel`` preset, zeropp, hybrid3d): its check at construction,
the ``ep`` entry of the mesh sizes, and the model's checks before launch; and its :class:`ExpertParallelPart` in a
step: with ``log_expert_load``, each training step logs every MoE layer's expert load (``max / mean`` tokens per
expert over the whole batch, :func:`~lightning_dist.parallel.expert_parallel.take_expert_load`) as
``expert_load/<experts module>``. How the experts are split is :mod:`lightning_dist.parallel.expert_parallel`; see
docs/expert_parallel.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.nn import Module

from lightning_dist.parallel.expert_parallel import (
    ExpertParallelError,
    check_expert_parallel,
    find_expert_layers,
    take_expert_load,
)
from lightning_dist.parallel.validation import check_bool, is_positive_int
from lightning_dist.strategies.lifecycle.step_part import StepPart, StepRun

if TYPE_CHECKING:
    from lightning_dist.parallel.tensor_parallel import TensorParallelPlan
    from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize

    _Base = MeshParallelStrategy
else:
    _Base = object


class ExpertParallelPart(StepPart):
    """The part of a strategy with :class:`ExpertParallelOption` on a mesh with ``ep > 1``."""

    strategy: ExpertParallelOption
    axis = "ep"

    def wrap_training_step(self, run: StepRun) -> StepRun:
        if not self.strategy.log_expert_load:
            return run

        def training_step(*args: Any, **kwargs: Any) -> Any:
            output = run(*args, **kwargs)
            self._log_load()
            return output

        return training_step

    def _log_load(self) -> None:
        strategy = self.strategy
        loads = take_expert_load(strategy.model, strategy.mesh["loss"].get_group())
        if strategy.parallel_dims.pp > 1:  # each stage counted its own layers: every rank logs all of them
            stages: list[Any] = [None] * strategy.parallel_dims.pp
            dist.all_gather_object(stages, loads, group=strategy.process_group("pp"))
            loads = {name: value for stage in stages for name, value in stage.items()}
        # the same values on every rank already (summed over the data-parallel ranks): no sync_dist
        strategy.lightning_module.log_dict({f"expert_load/{n}": v for n, v in loads.items()}, on_step=True)


class ExpertParallelOption(_Base):
    """``expert_parallel_size``: ep ranks borrowed from ``dp_shard × cp`` that split every MoE layer's experts."""

    declared_parts = (ExpertParallelPart,)

    def init_expert_parallel(
        self,
        size: MeshSize,
        expert_modules: str | None = None,
        log_expert_load: bool = False,
        dispatch_chunks: int = 1,
    ) -> None:
        """Check and keep the options: ``size`` (a positive int, 1: off, or ``"auto"``: all of dp_shard × cp),
        ``expert_modules`` (a pattern naming the experts modules, or ``None``: found from their structure),
        ``log_expert_load`` (log each MoE layer's max / mean tokens per expert every training step) and
        ``dispatch_chunks`` (token chunks whose all-to-alls overlap the experts' work; 1: none)."""
        if size != "auto" and not is_positive_int(size):
            raise ValueError(
                f"expert_parallel_size={size!r} is neither a positive int (1: off) nor 'auto' (every data-parallel"
                " shard rank)."
            )
        if expert_modules is not None and not (isinstance(expert_modules, str) and expert_modules):
            raise ValueError(
                f"expert_modules={expert_modules!r} is not a pattern of module names (e.g."
                " 'model.layers.*.mlp.experts'); leave it None to find the experts from their structure."
            )
        self.expert_parallel_size = size
        self.expert_modules = expert_modules
        self.log_expert_load = check_bool("log_expert_load", log_expert_load)
        if not is_positive_int(dispatch_chunks):
            raise ValueError(
                f"expert_dispatch_chunks={dispatch_chunks!r} is not a positive int: the number of chunks each MoE"
                " layer's tokens are sent in (1: one all-to-all each way; 2 or more: each chunk's all-to-all"
                " overlaps the experts' work on another)."
            )
        self.expert_dispatch_chunks = dispatch_chunks

    def expert_parallel_sizes(self) -> dict[str, MeshSize]:
        """The ``ep`` entry of :meth:`mesh_sizes` (none when the option is off)."""
        return {"ep": self.expert_parallel_size} if self.expert_parallel_size != 1 else {}

    def check_expert_parallel_model(self, model: Module, sequence_parallel: bool = False) -> None:
        """Before launch: the model's MoE layers can be split over the resolved ep (:func:`check_expert_parallel`),
        and ``sequence_parallel`` is not combined with tensor parallelism (the MoE block would route a slice of
        the sequence per tp rank, whose expert and router gradients are not what the replicated-over-tp experts
        expect)."""
        dims = self.parallel_dims
        if dims.ep == 1:
            return
        check_expert_parallel(model, dims.ep, self.expert_modules)
        if sequence_parallel and dims.tp > 1 and dims.ep > 1:
            raise ExpertParallelError(
                f"expert_parallel_size={dims.ep} with sequence_parallel=True over tp={dims.tp}: the experts are"
                " replicated over tp and expect the whole sequence on every tp rank, which sequence parallelism"
                " splits. Set sequence_parallel=False (the attention stays tensor-parallel), or drop"
                " expert_parallel_size."
            )

    def keep_experts_whole(self, plan: TensorParallelPlan, model: Module) -> TensorParallelPlan:
        """``plan`` without the modules of ``model``'s MoE layers under ep (in place): the experts and their router
        are replicated over tp, and every tp rank routes the same tokens. An automatic plan would shard a
        ``ModuleList``'s expert MLPs (litgpt) like any MLP; an explicit plan that names them is refused."""
        if self.parallel_dims.ep == 1:
            return plan
        try:
            layers = find_expert_layers(model, self.expert_modules)
        except ExpertParallelError:  # the pattern names no module of this part (a pipeline stage)
            return plan
        whole = {layer.name.rpartition(".")[0] if layer.kind == "module_list" else layer.name for layer in layers}
        whole |= {layer.router for layer in layers if layer.router}

        def inside(name: str) -> bool:
            return any(name == w or name.startswith(f"{w}.") for w in whole)

        sharded = [name for name in plan.styles if inside(name)]
        if sharded and plan.explicit:
            raise ExpertParallelError(
                f"plan= shards {', '.join(sharded[:4])} inside mixture-of-experts layers, which expert parallelism"
                " keeps whole on every tp rank (the experts are split over ep and replicated over tp). Leave the MoE"
                " layers out of the plan."
            )
        for name in sharded:
            del plan.styles[name]
        plan.checks = [check for check in plan.checks if not inside(check.module)]
        plan.head_attributes = {k: v for k, v in plan.head_attributes.items() if not inside(k)}
        plan.unreduced = {k: v for k, v in plan.unreduced.items() if not inside(k.rpartition(".")[0])}
        return plan

    def expert_parallel_on(self, part: Module) -> bool:
        """Whether :func:`~lightning_dist.parallel.parallelize.parallelize` splits ``part``'s experts: ep > 1 and
        the part (a pipeline stage) holds MoE layers."""
        if self.parallel_dims.ep == 1:
            return False
        try:
            return bool(find_expert_layers(part, self.expert_modules))
        except ExpertParallelError:  # the pattern names no module of this stage: the model's were checked before
            return False
