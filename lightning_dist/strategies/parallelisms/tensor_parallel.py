"""Tensor parallelism in a strategy: :class:`TensorParallelSteps` (a mixin before the shared base: the plan, its log
line) and its :class:`TensorParallelPart` in a step: with loss parallel, ``F.cross_entropy`` on vocabulary-sharded
logits from forward to the end of backward, a failure inside the step explained, and the step's loss checked to be a
local tensor; after backward, the gradients made consistent over tp; at setup, the plan of a model an earlier
Trainer parallelized. Used by ``tensor_parallel`` and ``hybrid3d``; the part acts where ``tp > 1``."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module, Parameter

from lightning_dist.parallel.fsdp import is_fully_sharded
from lightning_dist.parallel.replicated_state import (
    average_gradients,
    gradients_set_aside,
    sum_gradients,
    tp_replicated_parameters,
)
from lightning_dist.parallel.tensor_parallel import (
    TensorParallelPlan,
    TensorParallelPlanError,
    build_style,
    resolve_plan,
    shard_gradients_like_parameters,
    tp_sharded_parameters,
)
from lightning_dist.parallel.tensor_parallel.hugging_face import MODEL_PLAN
from lightning_dist.parallel.tensor_parallel.loss_parallel import (
    VocabParallelCrossEntropy,
    check_local_loss,
    explain_loss_parallel_failure,
)
from lightning_dist.parallel.tensor_parallel.partial_gradients import partial_over_tp_parameters
from lightning_dist.parallel.validation import check_bool
from lightning_dist.strategies.lifecycle.step_part import StepPart, StepRun

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object

PlanSpec = dict[str, str | dict[str, Any]] | Literal["model"]


class TensorParallelPart(StepPart):
    """The part of a strategy with :class:`TensorParallelSteps` on a mesh with ``tp > 1``."""

    strategy: TensorParallelSteps
    axis = "tp"

    def after_parallelize(self) -> None:
        self.strategy.find_tensor_parallel_gradients()

    def train_contexts(self) -> list[AbstractContextManager]:
        return [VocabParallelCrossEntropy()] if self.strategy.loss_parallel_head is not None else []

    def wrap_training_step(self, run: StepRun) -> StepRun:
        head = self.strategy.loss_parallel_head
        if head is None:
            return run

        def training_step(*args: Any, **kwargs: Any) -> Any:
            with explain_loss_parallel_failure(head):
                output = run(*args, **kwargs)
            check_local_loss(output)
            return output

        return training_step

    def manual_backward_context(self) -> AbstractContextManager:
        return gradients_set_aside(self.strategy._tp_partial)  # summed over tp: only this backward's part may be

    def make_gradients_consistent(self) -> None:
        strategy = self.strategy
        if strategy._tp_sharded:  # see shard_gradients_like_parameters
            shard_gradients_like_parameters(strategy._tp_sharded)
        if strategy._tp_partial:  # per-head norms: each tp rank holds its heads' part of the gradient
            sum_gradients(strategy._tp_partial, strategy.process_group("tp"))
        if strategy._tp_replicated:  # the copies must see identical gradients
            average_gradients(strategy._tp_replicated, strategy.process_group("tp"))


class TensorParallelSteps(_Base):
    """The tensor-parallel plan of a strategy and loss parallel around its training step."""

    declared_parts = (TensorParallelPart,)
    #: The applied plan (loss parallel, autocast), taken over by a later Trainer's strategy with the model (see
    #: ``lifecycle/model_handover``).
    parallelized_state = ("_tp_plan",)

    def init_tensor_parallel(self, plan: PlanSpec | None, sequence_parallel: bool, loss_parallel: bool) -> None:
        """Check and keep the tensor-parallel options (called from the strategy's ``__init__``): a misspelt style
        or layout fails here, before any launch."""
        if isinstance(plan, str) and plan != MODEL_PLAN:
            raise TensorParallelPlanError(
                f"plan={plan!r}: give a mapping of module names to styles, or {MODEL_PLAN!r} for the plan the model"
                " ships with (transformers' base_model_tp_plan), or leave it out for the automatic plan."
            )
        for key, spec in (plan or {}).items() if isinstance(plan, dict) else ():
            try:
                build_style(spec, key)
            except TensorParallelPlanError as err:
                raise TensorParallelPlanError(str(err) if str(err).startswith("plan[") else f"plan[{key!r}]: {err}")
        self.plan = (dict(plan) if isinstance(plan, dict) else plan) if plan else None
        self.sequence_parallel = check_bool("sequence_parallel", sequence_parallel)
        self.loss_parallel = check_bool("loss_parallel", loss_parallel)
        self._tp_plan: TensorParallelPlan | None = None
        self._model_plan_note = ""  # plan="model": how it differs from the automatic plan (for the log)
        self._tp_replicated: list[Parameter] = []
        self._tp_partial: list[Parameter] = []
        self._tp_sharded: list[Parameter] = []

    def tensor_parallel_plan(self, model: Module, needs_head: bool = True) -> TensorParallelPlan:
        """The plan this strategy applies to ``model`` (explicit ``plan=`` or the automatic one); sizes are checked
        against the mesh when it is applied. ``needs_head=False``: a pipeline stage without the output head."""
        plan = resolve_plan(model, self.plan, self.sequence_parallel, self.loss_parallel)
        if self.plan == MODEL_PLAN:  # compared with the automatic plan now, while the model is whole
            self._model_plan_note = _against_automatic(model, plan)
        if self.plan and self.loss_parallel and plan.loss_parallel_head is None and needs_head:
            raise TensorParallelPlanError(
                "loss_parallel=True, but the explicit plan keeps no output head's logits sharded on the vocabulary."
                " Give the head {style: colwise, output_layouts: shard(-1), use_local_output: false}."
            )
        if self.loss_parallel and plan.loss_parallel_head is None and needs_head:
            raise TensorParallelPlanError(
                "loss_parallel=True, but the automatic plan recognised no output head (an nn.Linear named one of"
                " lm_head, head, output, embed_out, ...). Pass an explicit `plan=` giving the head {style: colwise,"
                " output_layouts: shard(-1), use_local_output: false}, or turn loss_parallel off."
            )
        if self.plan and self.sequence_parallel and not plan.sequence_parallel:
            raise TensorParallelPlanError(
                "sequence_parallel=True, but the explicit plan has no sequence_parallel entries. Print the automatic"
                " plan with `lightning-dist plan --model ... --sequence-parallel` and start from it."
            )
        return plan

    def log_tensor_parallel_plan(self, model: Module, plan: TensorParallelPlan, changed: dict[str, str]) -> None:
        """Keep the applied plan and log it in one line."""
        if plan.loss_parallel_head is not None or self._tp_plan is None:
            self._tp_plan = plan
        if (message := plan.unplanned_message()) is not None:
            rank_zero_warn(message)
        extras = [
            name
            for name, on in (
                ("sequence_parallel", plan.sequence_parallel),
                ("loss_parallel", bool(plan.loss_parallel_head)),
            )
            if on
        ]
        self.log_decision(
            f"{self._which_plan()} over tp={self.parallel_dims.tp}: {plan.summary()}"
            + (f"; {_summarize_changes(changed)}" if changed else "")
            + (f"; {', '.join(extras)}" if extras else "")
            + " (full plan: `lightning-dist plan`)"
        )

    def _which_plan(self) -> str:
        if self.plan == MODEL_PLAN:
            return f"the model's own plan (plan='model'; {self._model_plan_note})"
        return "explicit plan" if self.plan else "auto plan"

    def find_tensor_parallel_gradients(self) -> None:
        """At setup: the parameters whose gradients the part makes consistent over tp after backward. A per-head
        norm's tp copies each hold part of its gradient (summed over tp); other copies average; without FSDP2, the
        gradients of sharded parameters are laid out as their parameters."""
        assert self.model is not None
        self._tp_partial = partial_over_tp_parameters(self.model)
        partial = {id(p) for p in self._tp_partial}
        self._tp_replicated = [p for p in tp_replicated_parameters(self.model, self.mesh) if id(p) not in partial]
        self._tp_sharded = tp_sharded_parameters(self.model) if not is_fully_sharded(self.model) else []

    @property
    def loss_parallel_head(self) -> str | None:
        """The output head whose logits stay sharded on the vocabulary (loss parallel), once a plan is applied."""
        return self._tp_plan.loss_parallel_head if self._tp_plan is not None else None


def _summarize_changes(changed: dict[str, str]) -> str:
    """``"n_head 4 → 2 in 3 modules"`` from ``{"blocks.0.attn.n_head": "4 → 2", ...}``."""
    counts: dict[str, int] = {}
    for name, change in changed.items():
        key = f"{name.rpartition('.')[2]} {change}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{key} in {n} module{'s' if n > 1 else ''}" for key, n in counts.items())


def _against_automatic(model: Module, plan: TensorParallelPlan) -> str:
    """How ``plan`` (the model's own) differs from the automatic plan of ``model``, in a few words."""
    from lightning_dist.parallel.tensor_parallel.plan import style_name

    auto = resolve_plan(model, None)
    ours, theirs = ({n: style_name(s) for n, s in p.styles.items()} for p in (auto, plan))
    differ = [f"{n}: {ours.get(n, 'whole')} automatically, {theirs.get(n, 'whole')} in the model's plan"
              for n in sorted(set(ours) | set(theirs)) if ours.get(n) != theirs.get(n)]  # fmt: skip
    if not differ:
        return "the same as the automatic plan"
    return f"{len(differ)} modules differ from the automatic plan: " + "; ".join(differ[:5]) + (
        " ..." if len(differ) > 5 else "")  # fmt: skip
