"""Loading a model state saved under other module names that differ only by a leading prefix.

A LightningModule usually holds the network as an attribute (``self.model = GPT(...)``): its checkpoint keys read
``model.transformer.h.0...``, where a Fabric loop that sets up the ``GPT`` itself saves ``transformer.h.0...``. A load
into either from the other finds the prefix and loads through a view of the model whose keys are the saved ones:
the model held under the prefix, or the submodule below it. The optimizer state, keyed by the same names, is read
through the same view. Nothing is renamed when the keys already overlap.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.nn import Module

from lightning_dist.compat.torch import state_tensors


def aligned_module(model: Module, saved_keys: Iterable[str]) -> Module:
    """``model``, or a view of it whose state-dict keys are ``saved_keys`` when the two differ by a leading prefix
    on every key (``model.`` added or removed)."""
    saved = set(saved_keys)
    own = [name for name, _ in state_tensors(model)]  # not a state dict: its hooks would run
    if not own or not saved or saved & set(own):
        return model
    added = _prefix_added(own, saved)
    if added is not None:
        return _held_under(model, added)
    removed = _prefix_added(list(saved), set(own))
    if removed is not None and all(key.startswith(removed) for key in own):
        return model.get_submodule(removed.rstrip("."))
    return model


def _prefix_added(keys: list[str], other: set[str]) -> str | None:
    """The prefix ``P`` (ending with ``.``) such that ``P + key`` is in ``other`` for every key of ``keys``."""
    first = keys[0]
    candidates = {k[: -len(first)] for k in other if k.endswith("." + first)}
    for prefix in sorted(candidates, key=len):
        if all(prefix + key in other for key in keys):
            return prefix
    return None


def _held_under(model: Module, prefix: str) -> Module:
    """A module holding ``model`` at the dotted path ``prefix`` (so its keys are ``prefix + key``)."""
    holder = Module()
    parent = holder
    *outer, last = prefix.rstrip(".").split(".")
    for name in outer:
        child = Module()
        parent.add_module(name, child)
        parent = child
    parent.add_module(last, model)
    return holder
