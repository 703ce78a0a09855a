"""Attention in a dry run as a GPU runs it.

``F.scaled_dot_product_attention`` picks its kernel by device. On a GPU, a query and value of different head
dimensions (DeepSeek's multi-head latent attention: 192 and 128) run a fused kernel (memory-efficient or cuDNN)
that keeps the output and one log-sum-exp per query; on the CPU, whose code path the dry run takes, the same call
falls back to the math kernel, which materializes the ``S × S`` scores in fp32: 8 GiB per layer at 128 heads and
4,096 tokens, a peak the GPU never reaches. Under :func:`fused_attention` such a call is a fused kernel's shapes:
the output, and for backward the saved query, key, value, output and log-sum-exp; the gradients take the inputs'
shapes. Calls whose head dimensions agree run torch's own CPU flash kernel, which keeps the same tensors.

The function itself is replaced (not a ``TorchFunctionMode``, which the autograd engine leaves while activation
checkpointing recomputes a block in backward: the recomputation would take the other kernel).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dist.compat import sdpa_builtin_home


class _FusedKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextmanager
def fused_attention() -> Iterator[None]:
    """Within the block, ``F.scaled_dot_product_attention`` with unequal query and value head dimensions runs as a
    fused kernel's shapes."""
    original = F.scaled_dot_product_attention

    @functools.wraps(original)
    def attention(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if query.shape[-1] != value.shape[-1]:
            return _FusedKernel.apply(query, key, value)
        # the builtin's home, looked up now: context parallelism replaces it there while it runs (also for
        # activation checkpointing's recomputation, where its function mode is off)
        return sdpa_builtin_home().scaled_dot_product_attention(query, key, value, *args, **kwargs)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
