"""What a ``self.log`` call asks for, read from its arguments as ``LightningModule.log`` binds them: the reduction
(``reduce_fx``) and whether, and over which group, the value is synced. The pipeline combines micro-batch values by
it; context parallelism warns about sums over ranks that hold the same samples."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn

_LOG_SIGNATURE = inspect.signature(LightningModule.log)
_TORCH_REDUCTIONS = {torch.mean: "mean", torch.sum: "sum", torch.max: "max", torch.min: "min"}


def log_options(name: str, value: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of the ``self.log(name, value, *args, **kwargs)`` call, defaults included, by name."""
    bound = _LOG_SIGNATURE.bind(None, name, value, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def reduction(reduce_fx: Any) -> str | None:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for the ``reduce_fx`` values Lightning accepts (its strings, any
    case, ``"avg"``, and the torch functions); ``None`` for anything else (Lightning refuses it)."""
    if isinstance(reduce_fx, str):
        name = reduce_fx.lower()
        name = "mean" if name == "avg" else name
        return name if name in ("mean", "sum", "max", "min") else None
    return _TORCH_REDUCTIONS.get(reduce_fx)


def combine(values: torch.Tensor, reduce_fx: Any) -> torch.Tensor:
    """The value of a whole batch from ``values``, the values of its parts stacked on dim 0 (each part's own
    reduction, as the step logged it): their sum, max or min, and for a mean (equal parts) their mean."""
    kind = reduction(reduce_fx)
    if kind == "sum":
        return values.sum(0)
    if kind == "max":
        return values.amax(0)
    if kind == "min":
        return values.amin(0)
    return values.mean(0)


@contextmanager
def log_replaced(module: nn.Module, log: Callable[..., Any]) -> Iterator[None]:
    """Inside the block, ``module.log`` (and ``log_dict``, which calls it) is ``log``; after it, what it was (an
    instance's own, or the class's)."""
    previous = module.__dict__.get("log")
    module.log = log
    try:
        yield
    finally:
        if previous is None:
            del module.log
        else:
            module.log = previous
