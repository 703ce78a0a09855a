"""Token dispatch and combine for expert parallelism: permute tokens by expert, send each to the rank holding its
expert with an uneven all-to-all, and bring the results back the same way. Dropless: every routed token is computed.

Rank ``r`` of an ep group of size ``ep`` holds the experts ``r·E/ep … (r+1)·E/ep − 1``. The all-to-all is
differentiable in both directions (its backward is the reverse all-to-all), so gradients reach the experts of every
rank and the hidden states of every token exactly: no value is rounded or dropped on the way, which makes the result
equal to one process's in fp64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist.compat import all_to_all_in_flight, is_fake_tensor


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv, group=ctx.group
        )
        return out, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """Send ``send[j]`` rows of ``x`` (in order) to rank ``j`` of ``group``, receive ``recv[j]`` rows from it;
    differentiable."""
    return _AllToAll.apply(x, send, recv, group)


@dataclass
class Dispatch:
    """How the rows of one layer's routed tokens were moved, to move the results back.

    Attributes:
        order: Index of each (token, k) pair in expert order (``argsort`` of the flat expert ids).
        send: Rows sent to each ep rank; ``recv``: rows received from each.
        local_order: Received rows sorted by local expert (they arrive grouped by source rank first).
        tokens_per_expert: Rows each local expert computes, in ``local_order``.
    """

    order: torch.Tensor
    send: list[int]
    recv: list[int]
    local_order: torch.Tensor
    tokens_per_expert: list[int]


def plan_dispatch(top_k_index: torch.Tensor, num_experts: int, group: Any) -> Dispatch:
    """Where each (token, k) row goes: every rank learns how many rows each of its local experts receives from each
    source rank (one small all-to-all of counts), and the orders that group them."""
    ep = dist.get_world_size(group)
    local = num_experts // ep
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    if is_fake_tensor(flat):
        return _balanced_dispatch(order, num_experts, group)
    counts = torch.bincount(flat, minlength=num_experts)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    send = counts.view(ep, local).sum(1).tolist()
    per_source = received.view(ep, local)
    recv = per_source.sum(1).tolist()
    expert_of_row = torch.repeat_interleave(
        torch.arange(local, device=counts.device).repeat(ep), per_source.reshape(-1)
    )
    local_order = torch.argsort(expert_of_row, stable=True)
    return Dispatch(order, send, recv, local_order, per_source.sum(0).tolist())


def _balanced_dispatch(order: torch.Tensor, num_experts: int, group: Any) -> Dispatch:
    """A dry run's routing, whose expert ids have no values: every expert gets an equal share of every rank's rows
    (the remainder to the first experts). The counts' all-to-all is issued as a real one is."""
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    local, rows = num_experts // ep, order.numel()
    counts = [rows // num_experts + (1 if e < rows % num_experts else 0) for e in range(num_experts)]
    sent = torch.zeros(num_experts, dtype=torch.long, device=order.device)
    dist.all_to_all_single(torch.empty_like(sent), sent, group=group)
    send = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]
    mine = counts[me * local : (me + 1) * local]
    local_order = torch.arange(sum(mine) * ep, device=order.device)
    return Dispatch(order, send, [sum(mine)] * ep, local_order, [c * ep for c in mine])


def dispatch(
    hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, group: Any
) -> tuple[torch.Tensor, Dispatch]:
    """Send each token to the ranks of the experts it was routed to. Returns the rows this rank's experts compute,
    grouped by local expert, and the :class:`Dispatch` that :func:`combine` undoes.

    Args:
        hidden: ``(tokens, hidden)`` this rank's tokens.
        top_k_index: ``(tokens, k)`` the global expert ids the model's router chose.
        num_experts: Experts of the layer over all ranks (``E``).
        group: The ep process group.
    """
    state = plan_dispatch(top_k_index, num_experts, group)
    return _send(hidden, state, top_k_index.shape[-1], group, all_to_all)[state.local_order], state


def combine(
    expert_out: torch.Tensor, state: Dispatch, top_k_weights: torch.Tensor, out_dtype: torch.dtype, group: Any
) -> torch.Tensor:
    """Send the experts' rows back to their tokens' ranks, weight them by the router's weights and sum the top-k
    contributions of each token. Returns ``(tokens, hidden)`` in ``out_dtype``."""
    return _weighted_sum(_send_back(expert_out, state, group, all_to_all), state, top_k_weights, out_dtype)


def dispatch_compute_combine(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    group: Any,
    compute: Callable[[torch.Tensor, list[int]], torch.Tensor],
    chunks: int = 1,
) -> torch.Tensor:
    """:func:`dispatch`, ``compute(rows, tokens_per_expert)`` (the local experts), :func:`combine`; with ``chunks``
    > 1 the tokens go in that many chunks whose all-to-alls overlap the experts' work on the chunk before: every
    chunk's rows are sent at once, the experts compute a chunk as soon as it has arrived (the next ones still
    travelling), and each chunk's results start back while the experts compute the next. Each token's result is
    computed as without chunks (the experts' weight gradients sum the chunks' rows in another order)."""
    if chunks == 1:
        rows, state = dispatch(hidden, top_k_index, num_experts, group)
        return combine(compute(rows, state.tokens_per_expert), state, top_k_weights, hidden.dtype, group)
    k = top_k_index.shape[-1]
    pieces = list(
        zip(hidden.tensor_split(chunks), top_k_index.tensor_split(chunks), top_k_weights.tensor_split(chunks))
    )
    plans = [plan_dispatch(index, num_experts, group) for _, index, _ in pieces]  # every count exchange first
    travelling = [_send(rows, plan, k, group, all_to_all_in_flight) for (rows, _, _), plan in zip(pieces, plans)]
    returning = []
    for arrived, plan in zip(travelling, plans):
        out = compute(arrived[plan.local_order], plan.tokens_per_expert)  # waits for this chunk only
        returning.append(_send_back(out, plan, group, all_to_all_in_flight))
    parts = [_weighted_sum(back, plan, w, hidden.dtype) for back, plan, (_, _, w) in zip(returning, plans, pieces)]
    return torch.cat(parts)


_Move = Callable[[torch.Tensor, list[int], list[int], Any], torch.Tensor]


def _send(hidden: torch.Tensor, state: Dispatch, k: int, group: Any, move: _Move) -> torch.Tensor:
    """Each (token, k) pair's token, in expert order, to the rank of its expert (by ``move``, an all-to-all)."""
    return move(hidden[state.order // k], state.send, state.recv, group)


def _send_back(expert_out: torch.Tensor, state: Dispatch, group: Any, move: _Move) -> torch.Tensor:
    """The experts' rows, out of local-expert order, back to the ranks their tokens came from."""
    return move(expert_out[_undo(state.local_order)], state.recv, state.send, group)


def _undo(order: torch.Tensor) -> torch.Tensor:
    """The permutation that puts ``x[order]`` back in ``x``'s order."""
    back = torch.empty_like(order)
    back[order] = torch.arange(len(order), device=order.device)
    return back


def _weighted_sum(
    returned: torch.Tensor, state: Dispatch, top_k_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    tokens, k = top_k_weights.shape
    # The model's own order of operations: each expert's output times its weight, cast, then summed over k.
    weighted = (returned[_undo(state.order)] * top_k_weights.reshape(-1, 1)).to(out_dtype)
    return weighted.view(tokens, k, -1).sum(1)
