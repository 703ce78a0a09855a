"""Causal-LM losses that shift labels inside the model (Hugging Face), under context parallelism. Pure PyTorch.

A Hugging Face causal LM given ``labels`` shifts them itself (token ``t`` predicts label ``t+1``) and averages the
cross-entropy over the tokens whose shifted label is not ``ignore_index``. On a sequence shard both are wrong: the
last token of each shard chunk would be paired with a label of the same chunk (or with padding), and the mean would
be over this shard's tokens only. :func:`shift_labels_hook` makes the model compute, on every rank, its part of the
loss of the whole sequence instead:

* the labels of every cp rank are gathered (integers: ``B·S`` elements per step), shifted over the *whole* sequence,
  and this rank's shard of the shifted labels is passed as ``shift_labels=`` (the model then uses them unshifted);
* ``num_items_in_batch = N / cp``, where ``N`` counts the non-ignored shifted labels of the whole sequence, makes the
  model return ``cp · (sum of this shard's token losses) / N``. The mean of that over the cp ranks (what the
  strategy logs and what averaging gradients over cp computes) is the mean over the whole sequence, exactly, however
  unevenly ``ignore_index`` labels fall on the shards.

Recognition is by behaviour, without importing ``transformers``: a module whose loss is ``ForCausalLMLoss`` (the
``loss_type`` Hugging Face derives from the class name, or that function set as ``loss_function``) and whose
``forward`` takes ``labels`` and ``**kwargs`` (through which the loss receives ``shift_labels``/``num_items_in_batch``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dist.compat.hugging_face import attention_implementation
from lightning_dist.parallel.context_parallel.dispatch import gather_sequence, local_positions, shard_sequence

CAUSAL_LM_LOSS = "ForCausalLM"
_CLASS_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def is_causal_lm(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face causal LM computing ``ForCausalLMLoss`` from ``labels`` it shifts."""
    if getattr(module, "config", None) is None or not hasattr(type(module), "loss_function"):
        return False
    custom = vars(module).get("_loss_function")
    if custom is not None:
        loss = getattr(custom, "__name__", "") == f"{CAUSAL_LM_LOSS}Loss"
    else:  # transformers falls back to ForCausalLMLoss when it derives no loss_type from the class name
        loss_type = getattr(module, "loss_type", "")
        loss = loss_type == CAUSAL_LM_LOSS or (loss_type is None and type(module).__name__.endswith(_CLASS_SUFFIXES))
    if not loss:
        return False
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    names = {p.name for p in parameters}
    return "labels" in names and any(p.kind is p.VAR_KEYWORD for p in parameters)


def find_causal_lm(model: nn.Module) -> str | None:
    """Qualified name of the outermost Hugging Face causal LM inside ``model`` (``""``: the model itself), if any."""
    return next((name for name, module in model.named_modules() if is_causal_lm(module)), None)


def is_causal_decoder(module: nn.Module) -> bool:
    """Whether a recognised causal LM attends causally (its config does not turn causality off)."""
    config = module.config
    return bool(getattr(config, "is_causal", True)) and not getattr(config, "is_encoder_decoder", False)


class PackedOrPaddedError(ValueError):
    """A causal-LM call under context parallelism whose attention is not plain causal over the whole sequence."""


def shift_labels_hook(
    module: nn.Module, group: dist.ProcessGroup | None, seq_len: int, layout: str
) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict] | None]:
    """A ``register_forward_pre_hook(..., with_kwargs=True)`` hook for a recognised causal LM: when the call passes
    ``labels`` (and neither ``shift_labels`` nor ``num_items_in_batch``), it adds the whole-sequence shift of the
    labels and their count, as described in the module docstring.

    It also refuses what plain causal attention over the shards cannot compute: a padding ``attention_mask``
    (any zero) and ``position_ids`` other than the global positions of the shard (packed sequences). When the call
    passes no ``attention_mask`` it passes one of ones: Hugging Face then builds no mask (its SDPA call is
    ``is_causal=True`` with grouped-query key/value heads left unexpanded) instead of reading the zigzag positions
    as packed sequences and building an explicit mask (for which it expands key/value heads to the query heads,
    multiplying what ring and all-gather attention send).

    Args:
        module: the causal LM (its ``forward`` signature binds the call's arguments).
        group: the context-parallel process group.
        seq_len: global sequence length of the current batch.
        layout: ``"zigzag"`` or ``"contiguous"``, how the batch was sharded.
    """
    signature = inspect.signature(module.forward)
    var_keyword = next(p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        bound = signature.bind_partial(*args, **kwargs).arguments
        extra = bound.get(var_keyword, {})
        check_plain_causal(type(mod).__name__, bound, seq_len, cp, rank, layout)
        added: dict[str, Any] = {}
        tokens = next((bound[n] for n in ("input_ids", "inputs_embeds") if isinstance(bound.get(n), Tensor)), None)
        if bound.get("attention_mask") is None and "attention_mask" in signature.parameters and tokens is not None:
            added["attention_mask"] = torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)
        labels = bound.get("labels")
        if labels is not None and "shift_labels" not in extra and "num_items_in_batch" not in extra:
            shifted, count = shift_whole_sequence(labels, group, layout, extra.get("ignore_index", -100))
            added["shift_labels"] = shard_sequence(shifted, cp, rank, layout).contiguous()
            added["num_items_in_batch"] = count.to(torch.float32) / cp  # exact: count < 2**24, cp a power of two
        if not added:
            return None
        return _with_arguments(signature, args, kwargs, added)

    return hook


def _with_arguments(
    signature: inspect.Signature, args: tuple, kwargs: dict, added: dict[str, Any]
) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with ``added`` set: by position where the call passed that parameter positionally."""
    positional = [
        p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    args = list(args)
    for name in list(added):
        index = positional.index(name) if name in positional else None
        if index is not None and index < len(args):
            args[index] = added.pop(name)
    return tuple(args), {**kwargs, **added}


def check_attention_implementation(name: str, module: nn.Module) -> None:
    """Refuse a Hugging Face model whose attention does not call ``F.scaled_dot_product_attention`` (``eager``,
    ``flash_attention_2``...): context parallelism routes SDPA, and any other attention would attend within each
    rank's shard only."""
    implementation = attention_implementation(module.config, "sdpa")
    if implementation != "sdpa":
        raise ValueError(
            f"Context parallel: {name} ({type(module).__name__}) computes attention with"
            f" attn_implementation={implementation!r}, which context parallelism cannot route: each rank would attend"
            " to its own shard only. Load or build the model with attn_implementation='sdpa'."
        )


def shift_whole_sequence(
    labels: Tensor, group: dist.ProcessGroup | None, layout: str, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """``(labels of the whole sequence shifted left by one, ignore_index at the end; their non-ignored count)``
    from every cp rank's shard ``labels: [B, S/cp]``."""
    whole = gather_sequence(labels, group, layout, dim=1)
    shifted = F.pad(whole[:, 1:], (0, 1), value=ignore_index)
    return shifted, (shifted != ignore_index).sum()


def check_plain_causal(name: str, bound: dict[str, Any], seq_len: int, cp: int, rank: int, layout: str) -> None:
    """Raise :class:`PackedOrPaddedError` when the call's ``attention_mask`` pads or its ``position_ids`` are not the
    shard's global positions: the causal mask a causal LM builds from them is computed as plain causal attention."""
    mask = bound.get("attention_mask")
    if isinstance(mask, Tensor) and not bool(mask.all()):
        raise PackedOrPaddedError(
            f"Context parallel: {name} got an attention_mask with padding (zeros). Attention over sequence shards is"
            " plain causal attention over the whole sequence: pack or pad the sequences to the full length without"
            " a padding mask, and mark the labels of padding tokens with -100 so the loss ignores them."
        )
    positions = bound.get("position_ids")
    if isinstance(positions, Tensor):
        expected = local_positions(seq_len, cp, rank, layout, positions.device)
        if positions.shape[-1] != expected.numel() or not bool((positions == expected).all()):
            raise PackedOrPaddedError(
                f"Context parallel: {name} got position_ids that are not the global positions 0..{seq_len - 1} of"
                " the sequence (packed sequences restart them). Attention over sequence shards is plain causal"
                " attention over the whole sequence: do not pass position_ids (the strategy passes the global ones)."
            )
