"""The layout of the strategies (issue 26): every registered strategy's steps are composed of parts instead of
overriding the same method up the MRO, and every file in ``lightning_dist/strategies/`` stays short."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dist
import lightning_dist.strategies

MAX_CLASSES_DEFINING_A_METHOD = 2
MAX_LINES = 300


def _registered_strategies() -> list[type]:
    classes = {entry["strategy"] for entry in StrategyRegistry.values()}
    ours = [cls for cls in classes if cls.__module__.startswith(f"{lightning_dist.__name__}.")]
    return sorted(ours, key=lambda cls: cls.__name__)


def _is_method(value: object) -> bool:
    return isinstance(
        value, (staticmethod, classmethod, property, functools.cached_property, functools.partialmethod)
    ) or callable(value)


def methods_defined_more_than_allowed(cls: type) -> dict[str, list[str]]:
    """Method names that more than two lightning_dist classes of ``cls.__mro__`` define (in their ``__dict__``),
    with those classes. Dunder methods are left out: constructors are chained on purpose (each strategy takes its
    own options and forwards the rest)."""
    owners: dict[str, list[str]] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith(f"{lightning_dist.__name__}."):
            continue
        for name, value in vars(klass).items():
            if name.startswith("__") and name.endswith("__") or not _is_method(value):
                continue
            owners.setdefault(name, []).append(klass.__name__)
    return {name: classes for name, classes in owners.items() if len(classes) > MAX_CLASSES_DEFINING_A_METHOD}


def test_the_registry_holds_every_strategy_class() -> None:
    names = {cls.__name__ for cls in _registered_strategies()}
    assert {"FSDP2Strategy", "ZeroPPStrategy", "Hybrid3DStrategy", "PipelineStrategy"} <= names


@pytest.mark.parametrize("cls", _registered_strategies(), ids=lambda cls: cls.__name__)
def test_no_method_is_defined_in_more_than_two_of_our_classes_of_the_mro(cls: type) -> None:
    assert methods_defined_more_than_allowed(cls) == {}


def test_the_count_sees_a_method_written_in_three_classes() -> None:
    class Base:
        def step(self) -> None: ...

    class Middle(Base):
        def step(self) -> None: ...

    class Leaf(Middle):
        def step(self) -> None: ...

    for klass in (Base, Middle, Leaf):
        klass.__module__ = "lightning_dist.strategies.example"
    assert methods_defined_more_than_allowed(Leaf) == {"step": ["Leaf", "Middle", "Base"]}
    assert methods_defined_more_than_allowed(Middle) == {}


def test_every_strategies_file_is_at_most_300_lines() -> None:
    root = Path(lightning_dist.strategies.__file__).parent
    lengths = {str(path.relative_to(root)): len(path.read_text().splitlines()) for path in root.rglob("*.py")}
    assert lengths, root
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}
