"""Registration of the strategy names with Lightning's ``StrategyRegistry``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies.fsdp2 import FSDP2Strategy
from lightning_dist.strategies.tensor_parallel import TensorParallelStrategy
from lightning_dist.strategies.zeropp import ZeroPPStrategy

STRATEGY_CLASSES = (FSDP2Strategy, TensorParallelStrategy, ZeroPPStrategy)


def register_strategies() -> None:
    """Register every lightning_dist strategy name; a second call (re-import) is a no-op.

    Lightning's built-in names are never overridden: ours all carry their own prefixes.
    """
    for cls in STRATEGY_CLASSES:
        cls.register_strategies(_OnlyNewNames(StrategyRegistry))


class _OnlyNewNames:
    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def register(self, name: str, strategy: type, description: str, **init_params: Any) -> None:
        if name in self._registry:
            if self._registry[name]["strategy"] is not strategy:
                raise RuntimeError(f"The strategy name {name!r} is already registered by another package.")
            return
        self._registry.register(name, strategy, description=description, **init_params)
