"""Finding a non-finite loss or gradient on any rank, and agreeing on it everywhere.

Every rank contributes two flags (its loss, its gradients) to one all-gather, so all ranks learn the same thing at
the same time: which ranks saw a non-finite value and where. That is what lets them all skip the step together, or
all stop with the same message, instead of one rank raising while the others wait in the next collective.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_dist.compat import foreach_norms, is_fake_tensor


@dataclass(frozen=True)
class NonFiniteReport:
    """Which ranks saw a non-finite loss and which non-finite gradients (global ranks, ascending)."""

    loss_ranks: tuple[int, ...]
    gradient_ranks: tuple[int, ...]

    @property
    def found(self) -> bool:
        return bool(self.loss_ranks or self.gradient_ranks)

    def describe(self) -> str:
        parts = []
        if self.loss_ranks:
            parts.append(f"a non-finite loss on rank {_ranks(self.loss_ranks)}")
        if self.gradient_ranks:
            parts.append(f"non-finite gradients on rank {_ranks(self.gradient_ranks)}")
        return " and ".join(parts)


class NonFiniteError(RuntimeError):
    """Raised on every rank when training stops at a non-finite loss or gradient."""


def gradients_are_finite(parameters: Iterable[Tensor]) -> bool:
    """Whether every local gradient element (a shard's, for DTensors) is finite. One fused norm per device: a norm is
    non-finite exactly when some element is."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters if p.grad is not None]
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    if any(is_fake_tensor(g) for g in grads):  # a dry run: no values
        return True
    return all(bool(torch.isfinite(torch.stack(foreach_norms(g)).sum())) for g in by_device.values())


def gather_non_finite(loss_finite: bool, grads_finite: bool, device: torch.device) -> NonFiniteReport:
    """All-gather both flags of every rank (one collective on the default group); returns the same report on every
    rank. Without a process group, this rank's flags alone."""
    flags = torch.tensor([not loss_finite, not grads_finite], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized():
        gathered = [torch.zeros_like(flags) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, flags)
    else:
        gathered = [flags]
    if is_fake_tensor(gathered[0]):  # a dry run: the collective is issued, no value is read
        return NonFiniteReport((), ())
    rows = [row.cpu().tolist() for row in gathered]
    return NonFiniteReport(
        loss_ranks=tuple(r for r, (loss, _) in enumerate(rows) if loss),
        gradient_ranks=tuple(r for r, (_, grads) in enumerate(rows) if grads),
    )


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) < 6 else f"{ranks[0]}, {ranks[1]}, … ({len(ranks)} ranks)"
