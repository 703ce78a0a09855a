"""The router's auxiliary load-balancing loss over the whole batch, as one process computes it.

transformers' MoE models add ``E · Σ_e f_e · P_e`` when called with ``output_router_logits=True`` (Switch
Transformer: ``f_e`` the fraction of routed (token, k) pairs sent to expert ``e``, ``P_e`` the mean router
probability of ``e``), computed by a module-level ``load_balancing_loss_func`` on the tokens the model sees. On
data-parallel ranks each sees part of the batch, and a mean of per-rank products is not the product of the batch's
means. :func:`reduce_router_statistics` replaces that function in the model's module (every model class of that
module is affected; the function is the same for all of them) with one that sums the counts, probabilities and
token numbers over the batch group first. Its value is the one-process value on every rank; its gradient is the
one-process gradient times the group size on each rank's own probabilities, which the data-parallel gradient mean
divides back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

FUNCTION = "load_balancing_loss_func"

#: Routing statistics of layers this process did not run (earlier pipeline stages): ``[counts | probs | rows]``.
_CARRIED: ContextVar[torch.Tensor | None] = ContextVar("lightning_dist_carried_router_statistics", default=None)


@contextmanager
def carried_statistics(statistics: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, the patched auxiliary loss adds ``statistics`` (``[counts (E) | probability sums (E) |
    rows (1)]``, see :func:`local_statistics`) to those of the layers it is given."""
    token = _CARRIED.set(statistics)
    try:
        yield
    finally:
        _CARRIED.reset(token)


def local_statistics(
    gate_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None,
    device: torch.device | str,
) -> torch.Tensor:
    """``[counts (E) | probability sums (E) | rows (1)]`` of the given router logits (zeros for none), fp32."""
    if not gate_logits:
        return torch.zeros(2 * num_experts + 1, dtype=torch.float32, device=device)
    counts, probs, rows = _local_sums(gate_logits, num_experts, top_k, attention_mask)
    return torch.cat([counts, probs, rows.reshape(1)])


def reduce_router_statistics(model: nn.Module, group: Any) -> list[str]:
    """Make the auxiliary loss of every transformers MoE model class in ``model`` use the batch statistics of
    ``group`` (the data-parallel ranks: their tokens make up the batch). Returns the modules patched."""
    patched: list[str] = []
    for module in model.modules():
        home = sys.modules.get(type(module).__module__)
        original = getattr(home, FUNCTION, None)
        if home is None or home.__name__ in patched or not callable(original):
            continue
        original = getattr(original, "single_process", original)  # patched before: wrap the original again
        setattr(home, FUNCTION, _over_group(original, group))
        patched.append(home.__name__)
    return patched


def _over_group(original: Callable[..., Any], group: Any) -> Callable[..., Any]:
    def load_balancing_loss_func(
        gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: torch.Tensor | None = None
    ) -> Any:
        carried = _CARRIED.get()
        if carried is None and (gate_logits is None or not isinstance(gate_logits, tuple)) or not dist.is_initialized():
            return original(gate_logits, num_experts, top_k, attention_mask)
        if carried is None:
            counts, probs, rows = _local_sums(gate_logits, num_experts, top_k, attention_mask)
        else:  # a pipeline's last stage: the earlier stages' statistics added to its own layers'
            mine = local_statistics(tuple(gate_logits or ()), num_experts, top_k, attention_mask, carried.device)
            both = carried + mine
            counts, probs, rows = both[:num_experts].detach(), both[num_experts:-1], both[-1].detach()
        totals = torch.cat([counts, probs.detach(), rows.reshape(1)])
        dist.all_reduce(totals, group=group)
        counts_all, probs_all, rows_all = totals[:num_experts], totals[num_experts:-1], totals[-1]
        fraction = counts_all / rows_all
        value = num_experts * torch.sum(fraction * probs_all / rows_all)
        own = num_experts * torch.sum(fraction * probs / rows_all) * dist.get_world_size(group)
        return value + (own - own.detach())

    load_balancing_loss_func.single_process = original  # type: ignore[attr-defined]
    return load_balancing_loss_func


def _local_sums(
    gate_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (token, k) counts per expert, router probability sums per expert and rows, over all layers, in
    fp32 as transformers computes them."""
    device = gate_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer in gate_logits:
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        weight = (
            torch.ones(chosen.numel(), dtype=torch.float32, device=device)
            if mask is None
            else mask.repeat_interleave(top_k)
        )
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), weight)
        if mask is None:
            probs = probs + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    return counts, probs, rows
