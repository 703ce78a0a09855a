"""Tensors without data: torch's ``FakeTensorMode``, answering the questions code asks of values.

A dry run computes every shape, dtype and collective of a step but no value. Two exceptions keep code that reads
values working:

* Small tensors (at most :data:`SMALL` elements) and integer ones that no fake tensor went into stay real (a device
  mesh's table of ranks, token ids, positions; a tensor made from Python data or a small factory (``torch.tensor([0 if ok else 1])``, the flags ranks exchange to refuse a step together;
  ``torch.zeros(1)``, the vote pipeline stages pass on; Adam's step count), and what ops make of them. A collective on
  the fake backend leaves such a tensor as it was, as if every rank sent the same, and reading it gives what this
  rank put in.
* Reading a fake tensor (``loss.item()`` for the progress bar, Adam's step count, ``bool(torch.isfinite(x).all())``)
  gets a neutral answer: ``True`` for a boolean, ``1`` for a number (Adam's bias correction divides by
  ``1 - beta**step``).

The package's own checks of computed values (the NaN check after materializing, the non-finite guard, loss-parallel's
target check) see fake tensors and skip themselves (:func:`~lightning_dist.compat.is_fake_tensor`); expert routing,
whose token counts are values, assumes a balanced router.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from lightning_dist.compat import (
    fake_tensor_mode_class,
    fake_tensor_of,
    fake_view,
    is_fake_tensor,
    item_op,
    lift_ops,
    metadata_ops,
    real_tensors_temporarily,
    view_ops,
)
from lightning_dist.profiling.live_memory import tensors_in

if TYPE_CHECKING:
    from lightning_dist.profiling import CommCounter

#: Tensors of at most this many elements, made without a fake input, are real.
SMALL = 16
_METADATA_OPS = metadata_ops()
_LIFT_OPS = lift_ops()
_VIEW_OPS = view_ops()


class DryRunTensorMode(fake_tensor_mode_class()):  # type: ignore[misc]
    """``FakeTensorMode`` that accepts real inputs (a batch from the user's loader) and answers ``.item()``; while
    :meth:`counting`, it records the collectives it sees."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.counter: CommCounter | None = None

    @contextlib.contextmanager
    def counting(self, counter: CommCounter) -> Iterator[None]:
        """Be the active mode and record collectives in ``counter`` (whose own mode is not active): one Python
        dispatch layer less than the counter's mode on top of this one, a fifth of a large dry run's time."""
        self.counter = counter
        try:
            with self:
                yield
        finally:
            self.counter = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # FakeTensorMode's own work is reached through `dispatch`: its `__torch_dispatch__` adds a call counter and a
        # second dynamo-disabling wrapper around each op, which this method's wrapper already is
        kwargs = kwargs or {}
        if func in _METADATA_OPS and is_fake_tensor(args[0]):
            return self.dispatch(func, types, args, kwargs)
        if func in _VIEW_OPS and fake_tensor_of(self, args[0]):  # a third of a step's ops; no view is a collective
            return fake_view(self, func, args, kwargs)
        if self.counter is not None and not self.counter.active:  # active: its own mode saw this op first
            self.counter.observe(func, args, kwargs)
        if func in _LIFT_OPS:
            return args[0]
        tensors = tensors_in((args, kwargs))
        if not any(is_fake_tensor(t) for t in tensors) and all(_stays_real(t) for t in tensors):
            if not tensors:
                return self._factory(func, types, args, kwargs)
            with real_tensors_temporarily():
                return func(*args, **kwargs)
        if func is item_op():
            return True if args[0].dtype == torch.bool else 1
        return self.dispatch(func, types, args, kwargs)

    def _factory(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """An op without tensor inputs: what the fake mode makes (no memory), unless that is only small tensors,
        which are made for real."""
        out = self.dispatch(func, types, args, kwargs)
        leaves = tensors_in(out)
        if leaves and all(_stays_real(t) for t in leaves):
            with real_tensors_temporarily():
                return func(*args, **kwargs)
        return out


def _stays_real(tensor: torch.Tensor) -> bool:
    """Small, or integer (a device mesh's rank table, token ids, positions): such tensors are computed for real."""
    return tensor.numel() <= SMALL or not (tensor.is_floating_point() or tensor.is_complex())


def on_real_tensors(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run with the fake tensor mode set aside (what it makes is real)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        with real_tensors_temporarily() as fake_mode, _counted_without(fake_mode):
            return function(*args, **kwargs)

    return call


def _counted_without(fake_mode: Any) -> contextlib.AbstractContextManager[Any]:
    """The collectives of a function run with ``fake_mode`` set aside still reach the counter it recorded them in."""
    counter = getattr(fake_mode, "counter", None)
    return counter if counter is not None and not counter.active else contextlib.nullcontext()
