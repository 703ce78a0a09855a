"""Context parallelism in pure PyTorch: sequence layouts and the SDPA dispatch.

A sequence of length ``S`` is split over the ``cp`` ranks of a context-parallel group in one of two layouts (defined
in :mod:`lightning_dist.parallel.context_parallel.attention.layout`, re-exported here):

* ``"contiguous"``: rank ``r`` holds tokens ``[r·S/cp, (r+1)·S/cp)``.
* ``"zigzag"`` (load-balanced for causal attention): the sequence is cut into ``2·cp`` chunks and rank ``r`` holds
  chunks ``r`` and ``2·cp−1−r``, so every rank does the same amount of causal-attention work.

:class:`ContextParallelAttention` is a context manager that sends every ``F.scaled_dot_product_attention`` call on
local shards to a context-parallel algorithm (``ring``, ``allgather`` or ``ulysses``) over a process group. It must
stay entered from the forward to the end of backward when activation checkpointing recomputes attention.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from typing_extensions import Self

from lightning_dist.compat import sdpa_builtin_home
from lightning_dist.parallel.context_parallel.attention import ALGORITHMS, context_parallel_attention
from lightning_dist.parallel.context_parallel.attention.layout import (
    LAYOUTS,
    check_layout,
    check_sequence_length,
    local_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "ALGORITHMS",
    "EXPLICIT_MASK_POLICIES",
    "LAYOUTS",
    "ContextParallelAttention",
    "ContextParallelAttentionError",
    "check_sequence_length",
    "gather_sequence",
    "local_positions",
    "shard_sequence",
    "unshard_sequence",
]

EXPLICIT_MASK_POLICIES = ("refuse", "causal")

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
        explicit_masks: ``"refuse"`` (default) raises on an explicit ``attn_mask``; ``"causal"`` computes causal
            attention over global positions instead. Use ``"causal"`` only for a model known to be a causal decoder
            whose library builds its causal mask itself from local shapes or positions (Hugging Face models do):
            such a mask is meaningless over shards, and the mask is not inspected.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        algorithm: str = "ring",
        layout: str = "zigzag",
        explicit_masks: str = "refuse",
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"Unknown context-parallel attention {algorithm!r}: use one of {list(ALGORITHMS)}.")
        if explicit_masks not in EXPLICIT_MASK_POLICIES:
            raise ValueError(f"explicit_masks={explicit_masks!r}: use one of {list(EXPLICIT_MASK_POLICIES)}.")
        check_layout(layout)
        self.group = group
        self.algorithm = algorithm
        self.layout = layout
        self.explicit_masks = explicit_masks
        self._mode: _SdpaMode | None = None
        self._patched: list[tuple[dict, str, Any]] = []

    def attention(self, *args: Any, **kwargs: Any) -> Tensor:
        """``F.scaled_dot_product_attention``'s signature, computed over the context-parallel group."""
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(*args, **kwargs)
        if query.device.type == "meta":  # a shape-only run (a pipeline stage's stand-in for an earlier stage)
            return query.new_empty((*query.shape[:-1], value.shape[-1]))
        if attn_mask is not None and self.explicit_masks == "causal":
            attn_mask, is_causal = None, True
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
            for namespace, name, original in reversed(self._patched):
                namespace[name] = original
            self._patched.clear()

    def _patch_everywhere(self) -> None:
        for namespace, name in _namespaces_holding_sdpa():
            self._patched.append((namespace, name, namespace[name]))
            namespace[name] = self.attention


_search_cache: dict[str, Any] = {"modules": -1, "found": []}


def _namespaces_holding_sdpa() -> list[tuple[dict, str]]:
    """The result of :func:`_search_namespaces`, searched again only when modules were imported since the last
    search (a search takes tens of milliseconds with large libraries imported)."""
    if _search_cache["modules"] != len(sys.modules):
        _search_cache["found"] = _search_namespaces()
        _search_cache["modules"] = len(sys.modules)
    return [(namespace, name) for namespace, name in _search_cache["found"] if namespace.get(name) is _ORIGINAL_SDPA]


def _search_namespaces() -> list[tuple[dict, str]]:
    """Every ``(namespace, name)`` whose value is the SDPA builtin: ``torch.nn.functional``'s, ``torch._C._nn``'s
    and those of modules that imported it by name.

    A script started by ``multiprocessing``'s spawn runs with globals that are a *copy* of its ``sys.modules``
    entry, so the globals of the functions and methods defined in ``__main__``/``__mp_main__`` are searched too.
    """
    found: list[tuple[dict, str]] = []
    seen: set[int] = {id(globals())}  # this module keeps the builtin to recognise it
    for namespace in _candidate_namespaces():
        if id(namespace) in seen:
            continue
        seen.add(id(namespace))
        found.extend((namespace, name) for name, value in list(namespace.items()) if value is _ORIGINAL_SDPA)
    return found


def _candidate_namespaces() -> Iterator[dict]:
    yield vars(F)
    yield vars(_SDPA_HOME)
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(module, ModuleType) or not isinstance(namespace, dict):
            continue
        yield namespace
        if module_name in ("__main__", "__mp_main__"):
            yield from _function_globals(namespace)


def _function_globals(namespace: dict) -> Iterator[dict]:
    """The globals of the functions, and of the methods of the classes, defined in ``namespace``."""
    for value in list(namespace.values()):
        members = vars(value).values() if isinstance(value, type) else (value,)
        for member in members:
            globals_ = getattr(member, "__globals__", None)
            if isinstance(globals_, dict) and globals_ is not namespace:
                yield globals_


class _SdpaMode(TorchFunctionMode):
    """Sends the SDPA builtin, however it was reached, to ``handler``; everything else runs unchanged."""

    def __init__(self, handler: Any) -> None:
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _ORIGINAL_SDPA:
            return self.handler(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
