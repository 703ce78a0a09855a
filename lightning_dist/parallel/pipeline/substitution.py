"""Running user code that calls a pipelined module once, without changing that code ("forward substitution").

A training step written for one process calls the model once (``logits = self(x)``) and computes the loss from its
output. Under pipeline parallelism that call is split across ranks. Two helpers make such code usable unchanged:

* :func:`capture_call` runs the user code only up to the model call and returns the call's arguments (what every
  rank passes to the pipeline);
* :func:`substituted_forward` makes the model call return a value computed elsewhere (the last stage's output for
  one micro-batch), so the user code's loss and logging run on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn


class _Captured(BaseException):
    """Stops the user code at the model call (BaseException: ``except Exception`` in user code must not catch it)."""

    def __init__(self, args: tuple, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class PipelinedCallError(RuntimeError):
    """The user code calls the pipelined module a number of times other than once."""


def capture_call(module: nn.Module, run: Callable[[], Any], what: str = "the step") -> tuple[tuple, dict[str, Any]]:
    """Run ``run()`` until it calls ``module``; return that call's ``(args, kwargs)``.

    Raises:
        PipelinedCallError: ``run()`` finished without calling ``module``.
    """

    def record(*args: Any, **kwargs: Any) -> Any:
        raise _Captured(args, kwargs)

    with _forward_replaced(module, record):
        try:
            run()
        except _Captured as captured:
            return captured.args, captured.kwargs
    raise PipelinedCallError(
        f"{what} never called {type(module).__name__}; under pipeline parallelism it must call the pipelined module"
        " exactly once."
    )


@contextmanager
def substituted_forward(module: nn.Module, output: Any, what: str = "the step") -> Iterator[None]:
    """Inside the block, the first call of ``module`` returns ``output``; a second call raises.

    Raises:
        PipelinedCallError: the block calls ``module`` twice, or not at all.
    """
    calls = 0

    def substitute(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise PipelinedCallError(
                f"{what} calls {type(module).__name__} more than once; under pipeline parallelism it must call the"
                " pipelined module exactly once."
            )
        return output

    with _forward_replaced(module, substitute):
        yield
    if calls == 0:
        raise PipelinedCallError(f"{what} did not call {type(module).__name__} on the pipeline's output.")


@contextmanager
def _forward_replaced(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    # An instance attribute shadows the class's forward; nn.Module.__call__ (and its hooks) still runs.
    had_own = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had_own:
            module.forward = previous
        else:
            del module.forward
