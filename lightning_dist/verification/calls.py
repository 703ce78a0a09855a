"""The module calls of one training step, with the shapes each received and returned: what tells where a model
reduced a dimension the strategy splits (see :func:`lightning_dist.verification.causes.reduced_before`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook

#: Calls recorded per step at most (a deep model calls thousands of modules; the first ones tell).
MAX_CALLS = 2000


def _shapes(value: Any) -> list[list[int]]:
    if isinstance(value, Tensor):
        return [list(value.shape)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [list(v.shape) for v in value if isinstance(v, Tensor)]
    return []


def _class_name(module: nn.Module) -> str:
    # FSDP2 and DTensor wrappers rename a module's class; the user's class is the first one not theirs
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed")).__name__


@contextmanager
def record_calls(root: nn.Module) -> Iterator[list[dict[str, Any]]]:
    """Yields a list that gets, for every call of a submodule of ``root`` while open, its name, class, and the
    shapes of the tensors it received (positional and keyword arguments) and returned."""
    names = {id(m): n for n, m in root.named_modules() if n}
    calls: list[dict[str, Any]] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = names.get(id(module))
        if name is not None and len(calls) < MAX_CALLS:
            inputs = [s for a in (*args, *kwargs.values()) for s in _shapes(a)]
            calls.append({"name": name, "class": _class_name(module), "inputs": inputs, "outputs": _shapes(output)})

    handle = register_module_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
