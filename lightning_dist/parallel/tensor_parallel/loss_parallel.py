"""Cross-entropy over vocabulary-sharded logits, without gathering them (loss parallel).

The output head keeps its logits sharded on the vocabulary (a DTensor ``Shard(-1)``). While
:class:`VocabParallelCrossEntropy` is active, ``F.cross_entropy`` called on such logits computes the loss from the
local shards with three small all-reduces over the logits' rows (max, sum of exponentials, target logit) and returns
an ordinary tensor. The backward pass needs no communication and no context: the gradient of each shard is its
softmax minus the one-hot target.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard
from torch.overrides import TorchFunctionMode

from lightning_dist.compat import is_fake_tensor


class LossParallelError(RuntimeError):
    """The model's loss cannot run on vocabulary-sharded logits."""


_HINT = " Set loss_parallel=False to compute the loss on full logits."


class _ShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, vocab_start: int, ignore_index: int, group: Any) -> Tensor:
        local_vocab = logits.shape[-1]
        row_max = logits.detach().amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        local_target = target - vocab_start
        valid = target != ignore_index
        here = valid & (local_target >= 0) & (local_target < local_vocab)
        index = torch.where(here, local_target, torch.zeros_like(local_target))
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * here
        dist.all_reduce(picked, group=group)
        loss = (sum_exp.log() - picked) * valid
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), index, here, valid)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        softmax, index, here, valid = ctx.saved_tensors
        grad = softmax.scatter_add(-1, index.unsqueeze(-1), -here.to(softmax.dtype).unsqueeze(-1))
        grad = grad * (grad_loss * valid).unsqueeze(-1)
        return grad, None, None, None, None


_REDUCTIONS = ("none", "mean", "sum")


def check_reduction(reduction: str) -> None:
    """Refuse a ``reduction`` that ``F.cross_entropy`` would refuse."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction (use one of {list(_REDUCTIONS)})")


def check_targets(target: Tensor, num_classes: int, ignore_index: int) -> None:
    """Raise, as ``F.cross_entropy`` does, for a class index outside ``[0, num_classes)`` that is not
    ``ignore_index`` (the sharded loss would otherwise silently count it as a target logit of 0)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= num_classes))
    if is_fake_tensor(bad):  # a dry run: no values to check
        return
    if bool(bad.any()):
        value = target[bad].reshape(-1)[0].item()
        raise LossParallelError(
            f"loss_parallel: target {value} is out of bounds for {num_classes} classes (targets must be in"
            f" [0, {num_classes}) or ignore_index={ignore_index})."
        )


def sharded_cross_entropy(logits: DTensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean") -> Tensor:
    """``F.cross_entropy(logits, target)`` for logits sharded on the class dim (dim 1) over a 1-D mesh."""
    check_reduction(reduction)
    if logits.device_mesh.ndim != 1 or logits.placements != (Shard(1),):
        raise LossParallelError(
            f"loss_parallel: expected logits sharded on the class dimension, got placements {logits.placements} of"
            f" a tensor of shape {tuple(logits.shape)}." + _HINT
        )
    if isinstance(target, DTensor) or target.is_floating_point():
        raise LossParallelError("loss_parallel supports class-index targets only, not probabilities." + _HINT)
    mesh = logits.device_mesh
    local = logits.to_local()
    vocab_start = mesh.get_local_rank() * (logits.shape[1] // mesh.size())
    if logits.shape[1] % mesh.size():
        raise LossParallelError(
            f"loss_parallel: vocabulary {logits.shape[1]} is not divisible by tensor_parallel_size={mesh.size()}."
        )
    rows = local.movedim(1, -1).reshape(-1, local.shape[1])
    if rows.dtype in (torch.float16, torch.bfloat16):
        rows = rows.float()  # as F.cross_entropy does under autocast
    flat_target = target.reshape(-1)
    check_targets(flat_target, logits.shape[1], ignore_index)
    losses = _ShardedCrossEntropy.apply(rows, flat_target, vocab_start, ignore_index, mesh.get_group())
    if reduction == "none":
        return losses.reshape(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (flat_target != ignore_index).sum()


class VocabParallelCrossEntropy(TorchFunctionMode):
    """Routes ``F.cross_entropy`` on vocabulary-sharded DTensor logits to :func:`sharded_cross_entropy`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            logits = args[0] if args else kwargs.get("input")
            if isinstance(logits, DTensor):
                return self._cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _cross_entropy(
        input: DTensor,
        target: Tensor,
        weight: Tensor | None = None,
        size_average: Any = None,
        ignore_index: int = -100,
        reduce: Any = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> Tensor:
        check_reduction(reduction)
        if weight is not None or label_smoothing or size_average is not None or reduce is not None:
            raise LossParallelError(
                "loss_parallel: F.cross_entropy with class weights, label smoothing or the deprecated size_average/"
                "reduce arguments is not supported on vocabulary-sharded logits." + _HINT
            )
        return sharded_cross_entropy(input, target, ignore_index=ignore_index, reduction=reduction)


def check_local_loss(output: Any) -> None:
    """Raise a clear error when a training step's loss is still a DTensor (computed by something other than
    ``F.cross_entropy`` on the sharded logits)."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if isinstance(loss, DTensor):
        raise LossParallelError(
            "loss_parallel=True, but the training step's loss was not computed by F.cross_entropy on the"
            " vocabulary-sharded logits (it is still a DTensor). Loss parallel supports models whose loss is"
            " F.cross_entropy of the output head's logits." + _HINT
        )


@contextmanager
def explain_loss_parallel_failure(head: str) -> Iterator[None]:
    """Turn a DTensor error inside a loss-parallel training step into a :class:`LossParallelError` that says what
    loss parallel supports and how to turn it off."""
    try:
        yield
    except LossParallelError:
        raise
    except Exception as err:
        if "DTensor" not in str(err):
            raise
        raise LossParallelError(
            f"loss_parallel=True: the training step failed on the vocabulary-sharded logits of {head!r}"
            f" ({type(err).__name__}: {err}). Loss parallel supports training steps that only pass the logits"
            " (reshaped as needed) to F.cross_entropy. Set loss_parallel=False to compute the loss on full logits."
        ) from err
