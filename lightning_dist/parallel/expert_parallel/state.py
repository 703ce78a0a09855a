"""What an expert-parallel layer keeps at call time, shared by both kinds of experts (:mod:`.apply`'s stacked
experts and :mod:`.module_list`'s ``ModuleList`` experts): :class:`ExpertParallelState`, the tokens its forward
counts (:func:`count_tokens`, read by :mod:`.load`) and :class:`ExpertGradient`, the scaling of the experts'
gradients to a data-parallel mean, summed over the ranks that hold the same experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ExpertParallelState:
    """What an expert-parallel experts module needs at call time."""

    group: Any
    num_experts: int
    grad_scale: float
    replica_group: Any = None
    load: torch.Tensor | None = None  # tokens this rank routed to each expert since the last look (see .load)
    chunks: int = 1  # token chunks whose all-to-alls overlap the experts' work (see dispatch_compute_combine)


class ExpertGradient(torch.autograd.Function):
    """Identity in forward; in backward the gradient is scaled to a data-parallel mean and summed over the ranks
    that hold the same experts."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float, replica_group: Any) -> torch.Tensor:
        ctx.scale, ctx.replica_group = scale, replica_group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad * ctx.scale
        if ctx.replica_group is not None:
            dist.all_reduce(grad, group=ctx.replica_group)
        return grad, None, None


def count_tokens(state: Any, counts: torch.Tensor) -> None:
    """Add ``counts`` (tokens per expert, this rank's, length ``num_experts``) to ``state.load``."""
    counts = counts.detach().to(torch.int64)
    state.load = counts if state.load is None else state.load + counts
