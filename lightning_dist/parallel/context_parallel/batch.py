"""Batches and positions under context parallelism (pure PyTorch helpers of the context-parallel strategy).

* :func:`sequence_entries` finds the tensors of a batch (a pytree of dicts, lists and tuples) that carry the sequence
  dimension, and refuses a batch that holds no token sequence (images, sets, feature vectors);
  :func:`shard_batch` replaces each with this rank's shard in the layout of the attention.
* :func:`fill_positions` makes a forward pre-hook that passes the shard's *global* positions to the module taking
  them (``position_ids``, ``input_pos``, ``positions``) whenever the caller passes none: a model that builds
  ``arange(local length)`` itself would otherwise train on wrong positions on every rank but the first.
* :func:`gather_outputs` puts the sequence of sharded step outputs (predictions) back together.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dist.parallel.context_parallel.dispatch import (
    check_sequence_length,
    gather_sequence,
    local_positions,
    shard_sequence,
)

Path = tuple[Any, ...]


def path_name(path: Path) -> str:
    """``("batch", 0, "ids")`` → ``"batch.0.ids"``: how :func:`sequence_entries` names an entry."""
    return ".".join(str(p) for p in path)


def batch_tensors(batch: Any, path: Path = ()) -> Iterator[tuple[Path, Tensor]]:
    """``(path, tensor)`` of every tensor in ``batch``, through dicts, lists and tuples."""
    if isinstance(batch, Tensor):
        yield path, batch
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from batch_tensors(value, (*path, key))
    elif isinstance(batch, (list, tuple)):
        for index, value in enumerate(batch):
            yield from batch_tensors(value, (*path, index))


def parse_sequence_keys(keys: list[str]) -> dict[str, int]:
    """``["input_ids", "labels:1", "mask:2"]`` → ``{name: sequence dim}`` (dim 1 unless given after a colon)."""
    parsed = {}
    for key in keys:
        name, _, dim = key.rpartition(":") if ":" in key else (key, "", "1")
        if not dim.lstrip("-").isdigit():
            raise ValueError(f"sequence_keys entry {key!r}: write 'name' or 'name:dim' (dim an integer).")
        parsed[name] = int(dim)
    return parsed


class NotASequenceError(ValueError):
    """A batch under context parallelism that holds no token sequence."""


def is_token_sequence(tensor: Tensor) -> bool:
    """Token ids (or labels, positions, an integer mask) of a batch of sequences: an integer ``[batch, sequence]``."""
    return (
        tensor.dim() == 2 and not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool
    )


def describe_tensors(batch: Any) -> str:
    """``"x: (8, 16, 4) float32, y: (8,) int64"``: the tensors of a batch, for messages."""
    return ", ".join(
        f"{path_name(p) or 'batch'}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
        for p, t in batch_tensors(batch)
    )


def sequence_entries(batch: Any, keys: dict[str, int] | None) -> tuple[dict[str, int], int]:
    """``({entry name: sequence dim}, global sequence length)`` of ``batch``.

    Without ``keys``: the sequence length is dim 1 of the first token sequence (an integer ``[batch, sequence]``
    tensor: token ids, labels); every tensor of two or more dims whose dim 1 has that length is an entry (per-token
    masks and weights, ``inputs_embeds``). A batch without a token sequence (images, sets, feature vectors) raises
    :class:`NotASequenceError`: the first dim after the batch is not a sequence there.
    With ``keys``: exactly those entries (a missing one is an error naming the entries the batch has).
    """
    tensors = {path_name(p): t for p, t in batch_tensors(batch)}
    if keys is None:
        first = next((t for t in tensors.values() if is_token_sequence(t)), None)
        if first is None:
            raise NotASequenceError(
                "Context parallel splits token sequences over ranks, but this batch holds none (an integer"
                f" [batch, sequence] tensor of token ids or labels): {describe_tensors(batch) or 'no tensors'}."
                " Images, sets of points and feature vectors cannot be split that way: each rank would see a part of"
                " every sample (and a pooled output would pool only that part), or the shapes would not fit."
                " Train such a model with strategy='fsdp2' (data parallel). If an entry is a sequence (e.g."
                " inputs_embeds [batch, sequence, width]), name it: sequence_keys=['name:1']."
            )
        seq_len = first.shape[1]
        return {n: 1 for n, t in tensors.items() if t.dim() >= 2 and t.shape[1] == seq_len}, seq_len
    missing = sorted(set(keys) - set(tensors))
    if missing:
        raise ValueError(f"sequence_keys {missing} are not tensors of the batch; it has {sorted(tensors)}.")
    lengths = {n: tensors[n].shape[d] for n, d in keys.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"The sequence_keys entries have different sequence lengths: {lengths}.")
    return dict(keys), next(iter(lengths.values()))


def check_entry_lengths(batch: Any, entries: dict[str, int], cp: int, layout: str) -> None:
    """Raise naming the entry whose sequence length ``layout`` cannot split over ``cp`` ranks."""
    for name, dim in entries.items():
        seq_len = _entry(batch, name).shape[dim]
        try:
            check_sequence_length(seq_len, cp, layout)
        except ValueError as err:
            raise ValueError(f"Batch entry {name!r} (sequence length {seq_len}): {err}") from None


def shard_batch(batch: Any, entries: dict[str, int], cp: int, rank: int, layout: str) -> Any:
    """``batch`` with every entry of ``entries`` replaced by rank ``rank``'s shard (the lengths checked first)."""
    check_entry_lengths(batch, entries, cp, layout)
    return _map(batch, (), lambda p, t: shard_sequence(t, cp, rank, layout, entries[path_name(p)]), set(entries))


def _entry(batch: Any, name: str) -> Tensor:
    return next(t for p, t in batch_tensors(batch) if path_name(p) == name)


def _map(batch: Any, path: Path, fn: Callable[[Path, Tensor], Tensor], names: set[str]) -> Any:
    if isinstance(batch, Tensor):
        return fn(path, batch) if path_name(path) in names else batch
    if isinstance(batch, dict):
        return type(batch)({k: _map(v, (*path, k), fn, names) for k, v in batch.items()}) if batch else batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map(v, (*path, i), fn, names) for i, v in enumerate(batch)))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(v, (*path, i), fn, names) for i, v in enumerate(batch))
    return batch


def fill_positions(
    module: nn.Module, argument: str, seq_len: int, cp: int, rank: int, layout: str
) -> Callable[..., Any]:
    """A ``register_forward_pre_hook(..., with_kwargs=True)`` hook giving ``module`` the global positions of this
    rank's shard as ``argument`` when the call passes none (or ``None``); positions the caller passes are kept.

    Calls that do not run ``module``'s own ``forward`` (Lightning's redirection of ``training_step`` through the
    root's ``__call__``) are left alone.
    """
    parameters = list(inspect.signature(module.forward).parameters.values())
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    index = positional.index(argument) if argument in positional else None  # None: keyword-only
    local = seq_len // cp

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        forward = mod.forward
        if not (inspect.ismethod(forward) and forward.__self__ is mod):
            return None
        by_position = argument not in kwargs and index is not None and len(args) > index
        passed = args[index] if by_position else kwargs.get(argument)
        if passed is not None:
            return None
        first = next((t for _, t in batch_tensors((args, kwargs)) if t.dim() >= 2 and t.shape[1] == local), None)
        device = first.device if first is not None else None
        positions = local_positions(seq_len, cp, rank, layout, device).unsqueeze(0)
        if first is not None:
            positions = positions.expand(first.shape[0], -1)
        if by_position:
            args = (*args[:index], positions, *args[index + 1 :])
        else:
            kwargs = {**kwargs, argument: positions}
        return args, kwargs

    return hook


def gather_outputs(
    output: Any, seq_len: int, cp: int, group: dist.ProcessGroup, layout: str, for_loss: bool = False
) -> Any:
    """Step outputs with every tensor whose dim 1 holds a shard (``seq_len / cp``) gathered back to ``seq_len``.

    ``for_loss``: through autograd, for a loss every cp rank computes alike from the whole sequence (a Fabric loop
    that shifts its labels itself): backward hands each rank its shard's gradient times ``cp``, so that averaging
    gradients over cp (as FSDP2 does over ``dp_shard × cp``) gives the whole sequence's."""
    names = {path_name(p) for p, t in batch_tensors(output) if t.dim() >= 2 and t.shape[1] == seq_len // cp}
    if for_loss:
        return _map(output, (), lambda _, t: _WholeSequence.apply(t, group, layout), names)
    return _map(output, (), lambda _, t: gather_sequence(t, group, layout, dim=1), names)


class _WholeSequence(torch.autograd.Function):
    """:func:`gather_sequence` on dim 1 whose backward is this rank's shard of the gradient times cp."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup, layout: str) -> Tensor:
        ctx.group, ctx.layout = group, layout
        return gather_sequence(local, group, layout, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        cp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return shard_sequence(grad, cp, rank, ctx.layout, dim=1) * cp, None, None
