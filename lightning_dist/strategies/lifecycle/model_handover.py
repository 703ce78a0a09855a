"""A parallelized model handed to a later Trainer (``Trainer(...).test(model)`` after ``fit``, a second ``fit``).

The model is parallelized once, by the first strategy that sets it up; a later strategy with the same settings
(checked before launch, :func:`~.preflight.check_same_parallelism`) reuses it as it is. What the first strategy
learned while parallelizing lives on the strategy, though: a pipeline's cut stages, where context parallelism passes
the global positions. Each strategy mixin names those attributes in ``parallelized_state``; they are kept on the
model after parallelizing and taken over by the next strategy. Without them a new pipeline strategy failed on a
reused model, and a new context-parallel one trained it with each rank's positions starting at 0, without a word.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_dist.strategies.lifecycle.layer_sync import apply_layer_sync
from lightning_dist.strategies.lifecycle.preflight import PARALLELIZED

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.strategies.base import MeshParallelStrategy

_ON_MODEL = "_lightning_dist_parallelized_state"


def parallelized_state_names(strategy: Any) -> list[str]:
    """The attributes of ``strategy`` its mixins declare as learned while parallelizing."""
    names: list[str] = []
    for klass in type(strategy).__mro__:
        names += vars(klass).get("parallelized_state", ())
    return list(dict.fromkeys(names))


def parallelize_or_adopt(strategy: MeshParallelStrategy, trainer: pl.Trainer) -> None:
    """Parallelize ``strategy.model`` (the Trainer's layer sync first) and keep what was learned on it; or, for a
    model an earlier strategy parallelized, take over what that one learned."""
    model = strategy.model
    if getattr(model, PARALLELIZED, None) is None:
        apply_layer_sync(strategy, trainer)  # Trainer(sync_batchnorm=True)
        strategy.prepare_model()
        state = {
            name: getattr(strategy, name) for name in parallelized_state_names(strategy) if hasattr(strategy, name)
        }
        object.__setattr__(strategy.model, _ON_MODEL, state)
    else:
        for name, value in getattr(model, _ON_MODEL, {}).items():
            setattr(strategy, name, value)
