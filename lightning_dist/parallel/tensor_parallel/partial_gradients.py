"""Parameters whose gradient each tensor-parallel rank computes only in part: a per-head norm (Qwen3's
``q_norm``/``k_norm``) sees this rank's heads, so the whole gradient is the sum over tp of the ranks' parts.

The plan names them (``TensorParallelPlan.partial_over_tp``); :func:`mark_partial_over_tp` records them on their
modules (module attributes survive FSDP2 wrapping and meta-device materialization, which make new parameter
objects), and :func:`partial_over_tp_parameters` finds them again at setup.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

_MARK = "_lightning_dist_partial_over_tp"


def mark_partial_over_tp(model: nn.Module, names: Iterable[str]) -> None:
    """Record each parameter name (``"layers.0.attn.q_norm.weight"``) on its module."""
    for name in names:
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        object.__setattr__(module, _MARK, {*getattr(module, _MARK, ()), leaf})


def partial_over_tp_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters :func:`mark_partial_over_tp` recorded, as they are now (after wrapping and materializing)."""
    found = []
    for module in model.modules():
        for leaf in sorted(getattr(module, _MARK, ())):
            param = getattr(module, leaf, None)
            if isinstance(param, nn.Parameter) and param.requires_grad:
                found.append(param)
    return found
