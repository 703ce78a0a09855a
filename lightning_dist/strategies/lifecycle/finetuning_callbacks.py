"""Lightning's ``BaseFinetuning`` callbacks (``BackboneFinetuning``) on a model that mixes DTensor and plain
parameters.

When a frozen module thaws, ``BaseFinetuning.filter_on_optimizer`` leaves out the parameters the optimizer already
holds by comparing values with ``torch.equal`` against every parameter in the optimizer. Tensor parallelism keeps the
parameters it does not split (norms, position embeddings) plain tensors beside its DTensors, and ``torch.equal`` of a
plain tensor and a DTensor raises ("got mixed torch.Tensor and DTensor"). While a strategy trains such a model, a
mixed pair is compared as Lightning compares any other: by value, the DTensor whole (a collective that every rank
runs in the same order: the parameter lists are the same on every rank), and only when the global shapes agree.
Same-kind pairs keep Lightning's own ``torch.equal``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    import lightning.pytorch as pl


def values_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, also between a DTensor and a plain tensor (the DTensor made whole: collective)."""
    if isinstance(a, DTensor) == isinstance(b, DTensor):
        return torch.equal(a, b)
    if a.shape != b.shape:
        return False
    whole = [t.full_tensor() if isinstance(t, DTensor) else t for t in (a, b)]
    return torch.equal(whole[0], whole[1].to(whole[0].device))


def _filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> list:
    params = list(params)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if len({isinstance(p, DTensor) for p in [*held, *params]}) < 2:  # one kind: Lightning's own comparison
        return _ORIGINAL[0](optimizer, params)
    new = [param for param in params if not any(values_equal(p, param) for p in held)]
    if len(new) < len(params):
        rank_zero_warn(
            "The provided params to be frozen already exist within another group of this optimizer. Those"
            " parameters will be skipped (BaseFinetuning.filter_on_optimizer)."
        )
    return new


_ORIGINAL: list[Callable[..., list]] = []  # Lightning's function while ours is installed


def compare_mixed_parameters(trainer: pl.Trainer) -> None:
    """Install the comparison for the run when ``trainer`` carries a ``BaseFinetuning`` callback (undone by
    :func:`restore_lightning_comparison` at teardown)."""
    from lightning.pytorch.callbacks import BaseFinetuning

    if not _ORIGINAL and any(isinstance(c, BaseFinetuning) for c in trainer.callbacks):
        _ORIGINAL.append(BaseFinetuning.filter_on_optimizer)
        BaseFinetuning.filter_on_optimizer = staticmethod(_filter_on_optimizer)  # type: ignore[method-assign]


def restore_lightning_comparison() -> None:
    from lightning.pytorch.callbacks import BaseFinetuning

    if _ORIGINAL:
        BaseFinetuning.filter_on_optimizer = staticmethod(_ORIGINAL.pop())  # type: ignore[method-assign]
