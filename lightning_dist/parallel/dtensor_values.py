"""Letting code written for plain tensors build tensors out of DTensor values.

Lightning's ``grad_norm(module)`` helper, which its docs show in ``on_before_optimizer_step``, computes one norm per
parameter and stacks them with ``torch.tensor([...])``. Under FSDP2 or tensor parallelism those norms are DTensors
(a shard's contribution, not yet reduced), and ``torch.tensor`` cannot read a DTensor's data. Inside
:class:`FullTensorValues`, ``torch.tensor``/``torch.as_tensor`` given a list holding DTensors first turn each one
into its full value (``full_tensor()``, a collective: every rank runs the same hook on the same parameters), so
the result is what one process, or DDP, computes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

_FACTORIES = (torch.tensor, torch.as_tensor)


class FullTensorValues(TorchFunctionMode):
    """Within the context, ``torch.tensor([...])`` of DTensor values sees their full (reduced) values."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES and args and isinstance(args[0], (list, tuple)):
            args = (_full_values(args[0]), *args[1:])
        return func(*args, **kwargs)


def _full_values(values: list | tuple) -> list:
    out = []
    for value in values:
        if isinstance(value, DTensor):
            value = value.full_tensor()
        elif isinstance(value, (list, tuple)):
            value = _full_values(value)
        out.append(value)
    return out
