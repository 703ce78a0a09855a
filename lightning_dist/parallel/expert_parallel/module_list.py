"""Expert parallelism for experts held as a ``ModuleList`` (litgpt's ``LLaMAMoE``, user code in that shape) whose
routing is written in the same ``forward`` as the loop over the experts.

The parent's ``forward`` stays the model's own code and runs twice per call ("record, then replay"):

1. **record**: every ``experts[e](rows)`` call keeps its input rows and returns zeros; nothing else of the pass is
   used (the random number generators are restored afterwards, so routing noise or dropout repeat exactly);
2. the rows of all experts travel to the ranks owning them in one uneven all-to-all (after one exchange of counts),
   each rank runs its own experts, and the results come back by one more all-to-all (:mod:`.dispatch`);
3. **replay**: the parent's ``forward`` runs again, and ``experts[e](rows)`` returns the rows computed for it, so the
   model's own code weights and sums them. Gradients reach the tokens through the rows recorded in the first pass.

That is 3 all-to-alls per MoE layer forward and 2 backward, as for transformers' stacked experts, at the price of
computing the router and the loop's indexing twice. A rank keeps only its experts: ``experts[e]`` of another rank is
a parameterless :class:`ExpertElsewhere`, so each parameter keeps its global name and shape
(``...experts.5.fc_1.weight``) on the one rank (and its replicas) that holds it, and a checkpoint has the keys and
shapes of plain fsdp2's. Where ep leaves data-parallel ranks (``ep_fsdp``), each held expert is an FSDP2 unit over
them (:mod:`.sharding`), called as a module in step 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.func import functional_call

from lightning_dist.parallel.expert_parallel.dispatch import combine, dispatch
from lightning_dist.parallel.expert_parallel.state import ExpertGradient, count_tokens
from lightning_dist.parallel.expert_parallel.structure import ExpertParallelError
from lightning_dist.parallel.grad_clip import count_in_norm_split_over

#: Set on the parameters of the experts a rank keeps, to the ep process group whose ranks hold the other experts
#: (the copies are replicated over ``ep_replicas`` only).
SPLIT_OVER_EP = "_lightning_dist_split_over_ep"


class ExpertElsewhere(nn.Module):
    """Stands in ``experts[index]`` on the ranks that do not hold that expert (no parameters)."""

    def __init__(self, index: int, owner: int) -> None:
        super().__init__()
        self.index, self.owner = index, owner

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise ExpertParallelError(
            f"expert {self.index} is held by ep rank {self.owner}: under expert parallelism only the MoE layer's own"
            " forward may call its experts."
        )

    def extra_repr(self) -> str:
        return f"expert {self.index} held by ep rank {self.owner}"


@dataclass
class ModuleListExperts:
    """One MoE layer's expert-parallel state (kept on the parent module as ``expert_parallel``).

    Attributes:
        attribute: The parent's attribute holding the experts list.
        local: The experts this rank holds, by global index.
        group: The ep process group; ``num_experts``: experts over all ranks.
        grad_scale: ``1 / data-parallel size``; ``replica_group``: ranks holding the same experts (or ``None``).
    """

    attribute: str
    local: dict[int, nn.Module]
    group: Any
    num_experts: int
    grad_scale: float
    replica_group: Any = None
    mode: str | None = None
    calls: list[list[torch.Tensor]] = field(default_factory=list)
    results: list[list[torch.Tensor]] = field(default_factory=list)
    slots: nn.ModuleList | None = None
    load: torch.Tensor | None = None  # tokens this rank routed to each expert since the last look (see .load)

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.local.values() for p in module.parameters()]

    def mark_parameters(self) -> None:
        """Mark the held experts' parameters as split over ep (see :data:`SPLIT_OVER_EP`; gradient clipping sums
        their norms over the ep ranks). Again after anything that replaces the parameter objects: materializing a
        meta-device model (``to_empty``) makes new ones, without the marks."""
        for param in self.parameters():
            setattr(param, SPLIT_OVER_EP, self.group)
            count_in_norm_split_over(param, self.group)


def mark_held_experts(model: nn.Module) -> None:
    """:meth:`ModuleListExperts.mark_parameters` for every ``ModuleList`` MoE layer of ``model``."""
    for module in model.modules():
        state = getattr(module, "expert_parallel", None)
        if isinstance(state, ModuleListExperts):
            state.mark_parameters()


class _Slot(nn.Module):
    """What the parent's forward calls as ``experts[e]`` while expert parallelism runs it."""

    def __init__(self, index: int, state: ModuleListExperts) -> None:
        super().__init__()
        self.index = index
        object.__setattr__(self, "state", state)  # not a submodule: the state holds the real experts

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        state = self.state
        if state.mode == "record":
            state.calls[self.index].append(rows)
            return torch.zeros_like(rows)
        results = state.results[self.index]
        if not results or results[0].shape[0] != rows.shape[0]:
            raise ExpertParallelError(
                f"expert {self.index} was called with {rows.shape[0]} rows when the MoE layer's forward ran again,"
                " not as the first time: expert parallelism runs that forward twice and needs its routing to repeat"
                " (it restores the random number generators; other state that changes between calls breaks it)."
            )
        return results.pop(0)


def apply_module_list(
    parent: nn.Module,
    attribute: str,
    rank: int,
    ep: int,
    group: Any,
    grad_scale: float,
    replica_group: Any = None,
) -> list[str]:
    """Keep this ep rank's experts of ``parent.<attribute>`` (a ``ModuleList``), put :class:`ExpertElsewhere` in the
    others' places and make ``parent``'s forward the record-and-replay one. Returns the kept parameters' names,
    relative to ``parent``."""
    experts: nn.ModuleList = getattr(parent, attribute)
    num_experts = len(experts)
    per_rank = num_experts // ep
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    local = {e: experts[e] for e in mine}
    for e in range(num_experts):
        if e not in local:
            experts[e] = ExpertElsewhere(e, e // per_rank)
    state = ModuleListExperts(attribute, local, group, num_experts, grad_scale, replica_group)
    state.mark_parameters()
    state.slots = nn.ModuleList(_Slot(e, state) for e in range(num_experts))
    parent.expert_parallel = state
    parent.__class__ = _record_and_replay_class(type(parent))
    return [f"{attribute}.{e}.{name}" for e in mine for name, _ in experts[e].named_parameters()]


def _run(self: nn.Module, original: Any, args: tuple, kwargs: dict) -> Any:
    state: ModuleListExperts = self.expert_parallel
    experts = getattr(self, state.attribute)
    setattr(self, state.attribute, state.slots)  # what the forward calls as experts[e] while it runs
    try:
        state.calls = [[] for _ in range(state.num_experts)]
        state.mode = "record"
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            original(self, *args, **kwargs)
        state.results = _exchange(state)
        state.mode = "replay"
        return original(self, *args, **kwargs)
    finally:
        setattr(self, state.attribute, experts)
        state.mode, state.calls, state.results = None, [], []


def _exchange(state: ModuleListExperts) -> list[list[torch.Tensor]]:
    """Every recorded call's rows to the expert's rank, through it, and back: the results in the calls' order."""
    if not any(state.calls):
        raise ExpertParallelError("the MoE layer's forward called none of its experts: nothing to route.")
    sizes = [[rows.shape[:-1].numel() for rows in calls] for calls in state.calls]
    rows = torch.cat([r.reshape(-1, r.shape[-1]) for calls in state.calls for r in calls])
    counts = torch.tensor([sum(s) for s in sizes], device=rows.device)
    count_tokens(state, counts)
    ids = torch.repeat_interleave(torch.arange(state.num_experts, device=rows.device), counts)
    arrived, moved = dispatch(rows, ids.unsqueeze(1), state.num_experts, state.group)
    outputs, start = [], 0
    for (index, module), count in zip(sorted(state.local.items()), moved.tokens_per_expert):
        outputs.append(_call_expert(module, arrived[start : start + count], state))
        start += count
    out = combine(torch.cat(outputs), moved, rows.new_ones((rows.shape[0], 1)), rows.dtype, state.group)
    results: list[list[torch.Tensor]] = []
    start = 0
    for calls, call_sizes in zip(state.calls, sizes):
        results.append([])
        for r, n in zip(calls, call_sizes):
            results[-1].append(out[start : start + n].reshape(*r.shape[:-1], out.shape[-1]))
            start += n
    return results


def _call_expert(module: nn.Module, rows: torch.Tensor, state: ModuleListExperts) -> torch.Tensor:
    """``module(rows)`` with its parameters' gradients scaled to the data-parallel mean and summed over the replicas
    (called even on no rows, so every rank's backward joins the same collectives). An expert FSDP2 shards over
    ep_fsdp is called as a module (its hooks gather its weights and reduce their gradients, averaged over ep_fsdp):
    only the ``1/ep`` is applied here, to the gradient of its output and undone on its input's."""
    if isinstance(module, FSDPModule):
        scaled = ExpertGradient.apply(rows, 1.0 / state.grad_scale, None)
        return ExpertGradient.apply(module(scaled), state.grad_scale, None)
    params = {
        name: ExpertGradient.apply(p, state.grad_scale, state.replica_group).to(
            rows.dtype if p.is_floating_point() else p.dtype
        )
        for name, p in module.named_parameters()
    }
    return functional_call(module, params, (rows,))


_CLASSES: dict[type, type] = {}


def _record_and_replay_class(cls: type) -> type:
    """A subclass of the MoE layer's class whose ``forward`` runs the original one twice (record, replay)."""
    if cls not in _CLASSES:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _run(self, cls.forward, args, kwargs)

        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": forward})
    return _CLASSES[cls]
