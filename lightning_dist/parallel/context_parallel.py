"""Context parallelism in pure PyTorch: sequence layouts and the SDPA dispatch.

A sequence of length ``S`` is split over the ``cp`` ranks of a context-parallel group in one of two layouts (defined
in :mod:`lightning_dist.parallel.attention.layout`, re-exported here):

* ``"contiguous"``: rank ``r`` holds tokens ``[r·S/cp, (r+1)·S/cp)``.
* ``"zigzag"`` (load-balanced for causal attention): the sequence is cut into ``2·cp`` chunks and rank ``r`` holds
  chunks ``r`` and ``2·cp−1−r``, so every rank does the same amount of causal-attention work.

:class:`ContextParallelAttention` is a context manager that sends every ``F.scaled_dot_product_attention`` call on
local shards to a context-parallel algorithm (``ring``, ``allgather`` or ``ulysses``) over a process group. It must
stay entered from the forward to the end of backward when activation checkpointing recomputes attention.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from typing_extensions import Self

from lightning_dist.compat import sdpa_builtin_home
from lightning_dist.parallel.attention import ALGORITHMS, context_parallel_attention
from lightning_dist.parallel.attention.layout import (
    LAYOUTS,
    check_layout,
    check_sequence_length,
    local_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "ALGORITHMS",
    "LAYOUTS",
    "ContextParallelAttention",
    "ContextParallelAttentionError",
    "check_sequence_length",
    "gather_sequence",
    "local_positions",
    "shard_sequence",
    "unshard_sequence",
]

# The builtin every spelling of SDPA resolves to: F.scaled_dot_product_attention is torch._C._nn's function.
_SDPA_HOME = sdpa_builtin_home()
_ORIGINAL_SDPA = _SDPA_HOME.scaled_dot_product_attention


def gather_sequence(x: Tensor, group: dist.ProcessGroup | None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """All-gather every rank's shard of ``x`` and put the sequence back in order (no autograd; for outputs)."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, layout, dim)


# ---------------------------------------------------------------------------------------------------- SDPA dispatch
class ContextParallelAttentionError(ValueError):
    """An SDPA call that context-parallel attention cannot compute correctly."""


def _sdpa_arguments(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, float, bool, float | None, bool]:
    """``F.scaled_dot_product_attention``'s signature, to bind positional and keyword arguments alike."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class ContextParallelAttention:
    """Context manager routing every ``F.scaled_dot_product_attention`` to context-parallel attention.

    Inside it, SDPA on the local sequence shards (``[B, H, S/cp, D]``, laid out as ``layout``) computes exactly the
    attention of the full sequence. Two mechanisms cover every spelling of SDPA:

    * a ``TorchFunctionMode`` catches the builtin however it was reached in forward (``F.…``, an early-bound
      ``from torch.nn.functional import scaled_dot_product_attention``, ``torch._C._nn.…``, a stored reference);
    * ``F.scaled_dot_product_attention``, ``torch._C._nn.scaled_dot_product_attention`` and every module-level name
      bound to the builtin are replaced until exit, because the autograd engine runs activation-checkpoint
      recompute in backward without Python function modes.

    Enter it before the forward and exit it after backward (LIFO with other torch-function modes). Outside it
    nothing is changed. A reference to SDPA stored elsewhere (e.g. an attribute) is only caught in forward: its
    recompute under activation checkpointing then fails with a ``CheckpointError`` rather than silently.

    Args:
        group: the context-parallel process group (``None``: the default group).
        algorithm: ``"ring"``, ``"allgather"`` or ``"ulysses"``.
        layout: how the sequence is sharded (``"zigzag"`` or ``"contiguous"``), as given to :func:`shard_sequence`.
    """

    def __init__(self, group: dist.ProcessGroup | None, algorithm: str = "ring", layout: str = "zigzag") -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"Unknown context-parallel attention {algorithm!r}: use one of {list(ALGORITHMS)}.")
        check_layout(layout)
        self.group = group
        self.algorithm = algorithm
        self.layout = layout
        self._mode: _SdpaMode | None = None
        self._patched: list[tuple[Any, str, Any]] = []

    def attention(self, *args: Any, **kwargs: Any) -> Tensor:
        """``F.scaled_dot_product_attention``'s signature, computed over the context-parallel group."""
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(*args, **kwargs)
        if attn_mask is not None:
            raise ContextParallelAttentionError(
                "Context parallel attention got an explicit attn_mask: only is_causal=True or no mask is supported"
                " (a mask over local shards cannot describe the full sequence). Pass is_causal=True instead of a"
                " causal mask, and no padding mask (pack or pad sequences to the full length)."
            )
        if dropout_p > 0:
            raise ContextParallelAttentionError(
                f"Context parallel attention got dropout_p={dropout_p}: attention dropout is not supported under"
                " context parallelism. Set the model's attention dropout to 0."
            )
        return context_parallel_attention(
            query,
            key,
            value,
            group=self.group,
            algorithm=self.algorithm,
            layout=self.layout,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    def __enter__(self) -> Self:
        if self._mode is not None:
            raise RuntimeError("ContextParallelAttention is already entered (it is not reentrant).")
        self._patch_everywhere()
        self._mode = _SdpaMode(self.attention)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        try:
            if mode is not None:
                mode.__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._patched):
                setattr(owner, name, original)
            self._patched.clear()

    def _patch_everywhere(self) -> None:
        for owner, name in _names_bound_to_sdpa():
            self._patched.append((owner, name, getattr(owner, name)))
            setattr(owner, name, self.attention)


def _names_bound_to_sdpa() -> list[tuple[Any, str]]:
    """Every ``(module, name)`` whose value is the SDPA builtin: ``torch.nn.functional``, ``torch._C._nn`` and any
    module that imported it by name."""
    found: list[tuple[Any, str]] = [(F, "scaled_dot_product_attention"), (_SDPA_HOME, "scaled_dot_product_attention")]
    for module in list(sys.modules.values()):
        if not isinstance(module, ModuleType) or module is F:
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is _ORIGINAL_SDPA:
                found.append((module, name))
    return [(owner, name) for owner, name in found if getattr(owner, name, None) is _ORIGINAL_SDPA]


class _SdpaMode(TorchFunctionMode):
    """Sends the SDPA builtin, however it was reached, to ``handler``; everything else runs unchanged."""

    def __init__(self, handler: Any) -> None:
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _ORIGINAL_SDPA:
            return self.handler(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
