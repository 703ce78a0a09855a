"""Choosing which submodules form the units of sharding, checkpointing and pipelining.

By default the units are the repeated blocks :mod:`lightning_dist.parallel.model_structure` finds (the transformer
layers of almost every model). Users can instead name classes or give a regex over qualified names.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Iterable

from torch import nn

from lightning_dist.parallel.model_structure import find_repeated_blocks
from lightning_dist.parallel.validation import check_regex

__all__ = ["ModuleSpec", "find_repeated_blocks", "resolve_module_classes", "select_modules", "summarize"]

ModuleSpec = type[nn.Module] | str


def resolve_module_classes(specs: Iterable[ModuleSpec]) -> tuple[set[type[nn.Module]], set[str]]:
    """Split ``specs`` into imported classes and bare class names.

    Class paths (``"examples.gpt.Block"``) are imported; bare names (``"Block"``) are matched later against the model.
    Raises ``ValueError`` for a class path that cannot be imported or does not name an ``nn.Module`` subclass.
    """
    classes: set[type[nn.Module]] = set()
    names: set[str] = set()
    for spec in specs:
        if isinstance(spec, type):
            if not issubclass(spec, nn.Module):
                raise TypeError(f"{spec!r} is not an nn.Module subclass; only module classes can be wrapped.")
            classes.add(spec)
        elif isinstance(spec, str) and "." in spec:
            module_path, _, attr = spec.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module_path), attr)
            except (ImportError, AttributeError) as err:
                raise ValueError(
                    f"Could not import the module class {spec!r} ({err}). Give a full class path such as"
                    " 'my_package.model.TransformerBlock', or just the class name."
                ) from err
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(f"{spec!r} resolves to {cls!r}, which is not an nn.Module subclass.")
            classes.add(cls)
        elif isinstance(spec, str):
            names.add(spec)
        else:
            raise ValueError(f"Expected a module class or a class path string, got {spec!r}.")
    return classes, names


def check_unit_choice(
    wrap_modules: Iterable[ModuleSpec] | None, wrap_regex: str | None
) -> tuple[list[ModuleSpec] | None, str | None]:
    """The ``wrap_modules``/``wrap_regex`` options of a strategy, checked when it is built: every class path must
    import and the regex must compile (a ``ValueError``/``ImportError`` naming the option otherwise)."""
    modules = list(wrap_modules) if wrap_modules is not None else None
    if modules is not None:
        resolve_module_classes(modules)
    return modules, check_regex("wrap_regex", wrap_regex)


def select_modules(
    model: nn.Module,
    classes: Iterable[ModuleSpec] | None = None,
    fqn_regex: str | None = None,
    *,
    what: str = "wrap",
) -> list[tuple[str, nn.Module]]:
    """Pick the units for ``what`` (used in messages): named classes, an FQN regex, or the repeated blocks.

    The root module itself is never returned. Raises ``ValueError`` when a named class or the regex matches nothing,
    listing the classes the model does contain.
    """
    if classes is None and fqn_regex is None:
        return find_repeated_blocks(model)
    selected: list[tuple[str, nn.Module]] = []
    if classes is not None:
        class_set, name_set = resolve_module_classes(classes)
        found = {type(m).__name__ for m in model.modules()}
        missing = sorted(name_set - found) + sorted(
            c.__qualname__ for c in class_set if c not in {type(m) for m in model.modules()}
        )
        if missing:
            raise ValueError(
                f"Cannot {what} {missing}: the model has no module of that class. Classes in the model:"
                f" {sorted(found)}."
            )
        selected = [
            (n, m)
            for n, m in model.named_modules()
            if n and (isinstance(m, tuple(class_set)) or type(m).__name__ in name_set)
        ]
    if fqn_regex is not None:
        pattern = re.compile(fqn_regex)
        by_regex = [(n, m) for n, m in model.named_modules() if n and pattern.fullmatch(n)]
        if not by_regex:
            raise ValueError(f"The regex {fqn_regex!r} matches no module name of the model to {what}.")
        known = {n for n, _ in selected}
        selected += [(n, m) for n, m in by_regex if n not in known]
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        selected.sort(key=lambda item: order[item[0]])
    return selected


def summarize(modules: list[tuple[str, nn.Module]]) -> str:
    """``"12 × Block"``-style summary of selected modules, by class."""
    counts = Counter(type(m).__name__ for _, m in modules)
    return ", ".join(f"{n} × {cls}" for cls, n in counts.items()) or "no modules"
