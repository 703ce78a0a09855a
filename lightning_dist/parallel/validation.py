"""Type checks for user options, shared by every strategy and tool.

Options arrive from Python, YAML and the command line. YAML already turns ``yes``/``no`` into booleans, but Python
callers can pass ``"no"`` (truthy) or ``1``: a flag that silently reads a string as ``True`` switches a feature on
that the user meant to switch off, so flags accept real booleans only.
"""

from __future__ import annotations

import re
from typing import Any


def check_bool(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool; raise a ``TypeError`` naming the option otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False (a bool), not a {type(value).__name__}.")
    return value


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int and not a bool (``True`` is an int to Python, never a size to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value: Any, minimum: int = 1) -> bool:
    return is_int(value) and value >= minimum


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``; raise a ``ValueError`` otherwise."""
    if not is_positive_int(value, minimum):
        raise ValueError(f"{name}={value!r} must be an int of at least {minimum}.")
    return value


def check_regex(name: str, pattern: str | None) -> str | None:
    """Return ``pattern`` if it is ``None`` or compiles as a regular expression; raise a ``ValueError`` otherwise."""
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise TypeError(f"{name}={pattern!r} must be a regular expression string.")
    try:
        re.compile(pattern)
    except re.error as err:
        raise ValueError(f"{name}={pattern!r} is not a valid regular expression: {err}.") from None
    return pattern
