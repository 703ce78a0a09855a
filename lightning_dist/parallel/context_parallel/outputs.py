"""Refusing, on the first step, a model whose output has lost the sequence dimension under context parallelism.

Context parallelism is exact for per-token outputs: each rank computes the outputs of its tokens, and the mean of
the ranks' per-token losses is the whole sequence's. A model that pools over the sequence (a mean- or CLS-pooled
sequence classifier, a set or image model) returns one output per sample; each rank would pool only its shard, and
the result is silently wrong. Only the step can tell (a pooled model and a language model can look alike), so
:func:`watch_pooled_outputs` watches the model calls a step makes and records a :class:`PooledOutputError` for the
first one that receives this rank's shard and returns no tensor that keeps it; the caller raises it before backward
and the optimizer step. Pure PyTorch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lightning_dist.parallel.context_parallel.batch import batch_tensors, path_name


class PooledOutputError(ValueError):
    """A model call under context parallelism whose output has lost the sequence dimension."""


def _holds_length(value: Any, length: int) -> bool:
    return any(t.dim() >= 2 and length in t.shape[1:] for _, t in batch_tensors(value))


def pooled_output(args: Any, output: Any, local_len: int) -> Tensor | None:
    """The first non-scalar tensor of ``output`` when the call got a tensor holding the shard (a dim after the first
    of length ``local_len``) and no output tensor keeps such a dim; ``None`` otherwise (scalars: a loss)."""
    if not _holds_length(args, local_len):
        return None
    tensors = [t for _, t in batch_tensors(output) if t.dim() >= 1]
    if not tensors or any(t.dim() >= 2 and local_len in t.shape[1:] for t in tensors):
        return None
    return tensors[0]


@contextmanager
def watch_pooled_outputs(
    root: nn.Module, seq_len: int, cp: int, step: str = "training_step"
) -> Iterator[list[PooledOutputError]]:
    """Yields a list that gets a :class:`PooledOutputError` (naming the module and the output shape) for the first
    call of a module holding parameters, made directly by the step (one level below the call of ``root`` that runs
    it) with a tensor holding this rank's shard (``seq_len / cp`` positions), that returns no tensor keeping those
    positions.

    Modules without parameters (losses, metrics) are not watched, nor calls made inside other modules.
    """
    found: list[PooledOutputError] = []
    local = seq_len // cp
    depth = [0]
    names = {id(m): n for n, m in root.named_modules()}

    def enter(module: nn.Module, args: tuple) -> None:
        depth[0] += 1

    def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        depth[0] -= 1
        if found or depth[0] != 1 or next(module.parameters(), None) is None:
            return
        pooled = pooled_output((args, kwargs), output, local)
        if pooled is None:
            return
        name = names.get(id(module))
        cls = next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed"))  # not FSDPX
        what = cls.__name__ if not name else f"{name} ({cls.__name__})"
        where = next((path_name(p) for p, t in batch_tensors(output) if t is pooled), "")
        found.append(
            PooledOutputError(
                f"Context parallel: in {step}, {what} got sequences sharded over cp={cp} ({local} of {seq_len} positions"
                f" on this rank) and returned {where or 'an output'} of shape {tuple(pooled.shape)}, which has no"
                " sequence dimension: the model pools over the sequence (a mean- or CLS-pooled sequence classifier, a set"
                " or image model), so each rank would pool only its own shard. Context parallelism is exact only for"
                " per-token outputs and losses. Train this model with strategy='fsdp2' (data parallel); if the batch"
                " entry split here is not a sequence, name the sequence entries with sequence_keys."
            )
        )

    handles = [
        register_module_forward_pre_hook(enter),
        register_module_forward_hook(leave, with_kwargs=True, always_call=True),
    ]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
