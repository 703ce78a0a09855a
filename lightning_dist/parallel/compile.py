"""``torch.compile`` as one step of :func:`lightning_dist.parallel.parallelize`, and models users compiled themselves.

The option every strategy takes is ``compile``: ``False`` (default), ``True`` (``torch.compile``'s defaults) or a
dict of ``torch.compile`` keyword arguments (``{"mode": "max-autotune-no-cudagraphs", "dynamic": False}``).
:func:`resolve_compile_options` turns it into the keyword arguments (or ``None``), refusing anything else before a
process is launched.

Modules are compiled in place with :meth:`torch.nn.Module.compile`, never by wrapping them in an
``OptimizedModule``: module and parameter names (and so checkpoint keys) stay those of the uncompiled model. A
user's ``torch.compile(module)`` wrappers inside the model are taken apart by :func:`unwrap_user_compiled` (the
strategy then compiles per block, or keeps the user's settings on the same module with
:func:`keep_user_compilation`). Pure PyTorch, no Lightning.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_dist.compat import compile_like, compile_mode_names, compiled_inner_module, compiled_module_class


def compile_keyword_names() -> list[str]:
    """The keyword arguments ``torch.compile`` accepts (besides the model)."""
    parameters = inspect.signature(torch.compile).parameters
    return [name for name in parameters if name != "model"]


def resolve_compile_options(compile: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``torch.compile`` keyword arguments for the ``compile`` option, or ``None`` when it is off.

    Raises ``TypeError``/``ValueError`` with the accepted forms for anything but a bool or a dict of known keywords.
    """
    if compile is None or compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, Mapping):
        names = compile_keyword_names()
        unknown = [key for key in compile if key not in names]
        if unknown or not all(isinstance(key, str) for key in compile):
            raise ValueError(
                f"compile={dict(compile)!r}: {', '.join(repr(k) for k in unknown)} is not a keyword of torch.compile."
                f" Its keywords are: {', '.join(names)}."
            )
        if "backend" in compile and not (isinstance(compile["backend"], str) or callable(compile["backend"])):
            raise ValueError(f"compile: backend={compile['backend']!r} is neither a backend name nor a callable.")
        if "mode" in compile and compile["mode"] is not None:
            modes = compile_mode_names()
            if compile["mode"] not in modes:
                raise ValueError(f"compile: mode={compile['mode']!r} is not one of {modes}.")
        return dict(compile)
    raise TypeError(
        f"compile={compile!r} ({type(compile).__name__}): expected False (default), True (torch.compile's defaults)"
        " or a dict of torch.compile keyword arguments, e.g. {'mode': 'max-autotune-no-cudagraphs'}."
    )


def unwrap_user_compiled(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Replace every ``OptimizedModule`` below ``module`` by the module it wraps, in place (outermost first).

    Returns ``(name, wrapper)`` for each, named without ``_orig_mod.``. Parameters are the wrapped module's own, so
    nothing is copied and an optimizer built over them stays valid.
    """
    wrapper_class = compiled_module_class()
    replaced: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, parent = stack.pop()
        for child_name, child in list(parent.named_children()):
            while isinstance(child, wrapper_class):
                replaced.append((f"{prefix}{child_name}", child))
                child = compiled_inner_module(child)
                setattr(parent, child_name, child)
            stack.append((f"{prefix}{child_name}.", child))
    return replaced


def keep_user_compilation(unwrapped: Iterable[tuple[str, nn.Module]]) -> None:
    """Compile each unwrapped module in place with the settings of the user's ``torch.compile`` call (backend,
    mode, options), as :meth:`torch.nn.Module.compile` would with the same arguments."""
    for _, wrapper in unwrapped:
        compile_like(wrapper, compiled_inner_module(wrapper))


def describe_compile_options(options: Mapping[str, Any]) -> str:
    """``torch.compile(mode='max-autotune')`` for log lines (``torch.compile()`` for the defaults)."""
    return f"torch.compile({', '.join(f'{k}={v!r}' for k, v in options.items())})"


def compile_modules(modules: Iterable[nn.Module], options: Mapping[str, Any]) -> int:
    """Compile each module in place (:meth:`torch.nn.Module.compile`); returns how many were compiled."""
    count = 0
    for module in modules:
        module.compile(**options)
        count += 1
    return count
