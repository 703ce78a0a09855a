"""What a rank holds, as one process would hold it: parameters, gradients and optimizer states as whole CPU tensors,
in the model's own row order, under the names of the user's module.

Every function that reads a DTensor is a collective over that DTensor's mesh: every rank of the mesh must call it
on the same parameters in the same order (they do: ranks of one mesh hold the same modules).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_dist.parallel.tensor_parallel import permuted_parameters, to_checkpoint_order

_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
# Module wrappers that add a segment to parameter names: activation checkpointing, torch.compile, FSDP1-style.
_WRAPPER_SEGMENTS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.)")


def user_name(name: str) -> str:
    """``name`` without the segments wrappers insert (``_orig_mod``, ``_checkpoint_wrapped_module``)."""
    return _WRAPPER_SEGMENTS.sub("", name).lstrip(".")


def _whole(tensor: Tensor, permuted: tuple[Any, int, Tensor] | None) -> Tensor:
    # gathered and detached first: reordering a parameter (a tensor that requires grad) as a DTensor fails
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    tensor = tensor.detach()
    if permuted is not None:  # fused q/k/v rows under tensor parallelism: back to the model's order
        tensor = to_checkpoint_order(tensor, permuted[1], permuted[2])
    return tensor.to("cpu", copy=True)


def _named_parameters(module: nn.Module) -> Any:
    """Every parameter under every name, tied copies included: a pipeline stage holds its own copy of a weight that
    one process holds once under two names (a tied embedding and output head), so both sides record both names."""
    return module.named_parameters(remove_duplicate=False)


def full_parameters(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter this rank holds, whole, by user name (collective over each DTensor's mesh)."""
    permuted = permuted_parameters(module)
    return {user_name(n): _whole(p, permuted.get(n)) for n, p in _named_parameters(module)}


def full_gradients(module: nn.Module) -> dict[str, Tensor | None]:
    """The gradient of every parameter this rank holds, whole, by user name (``None``: no gradient)."""
    permuted = permuted_parameters(module)
    return {
        user_name(n): None if p.grad is None else _whole(p.grad, permuted.get(n)) for n, p in _named_parameters(module)
    }


def full_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, dict[str, Tensor | float]]:
    """The optimizer's state of every parameter of ``module`` it holds: user name → state name → whole value."""
    permuted = permuted_parameters(module)
    states: dict[str, dict[str, Tensor | float]] = {}
    for name, param in _named_parameters(module):
        state = optimizer.state.get(param)
        if not state:
            continue
        values: dict[str, Tensor | float] = {}
        for key, value in sorted(state.items()):
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape == param.shape:
                values[key] = _whole(value, permuted.get(name))
            elif isinstance(value, Tensor):
                values[key] = float(value.full_tensor() if isinstance(value, DTensor) else value)
            elif isinstance(value, (int, float)):
                values[key] = float(value)
        states[user_name(name)] = values
    return states


def zero_dropout(module: nn.Module) -> list[str]:
    """Set every dropout probability in ``module`` to 0 and return the names of what was changed.

    Dropout draws cannot agree between layouts: one process draws one mask for the global batch, each rank its own
    for its part. ``nn.Dropout`` modules, and the float attributes models keep for functional dropout
    (``attention_dropout``, ``attn_pdrop``, ...), are zeroed.
    """
    changed = []
    for name, sub in module.named_modules():
        if isinstance(sub, _DROPOUT_MODULES) and sub.p > 0:
            sub.p = 0.0
            changed.append(name)
            continue
        for attr, value in list(vars(sub).items()):
            if isinstance(value, float) and value > 0 and ("dropout" in attr or "pdrop" in attr):
                setattr(sub, attr, 0.0)
                changed.append(f"{name}.{attr}" if name else attr)
    return changed


def load_initial_weights(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` (the parameters and buffers of an identical module) into ``module``, in place."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            "verify could not give both runs the same initial weights: the module built in this process does not have"
            f" the same parameters as the one built first (missing {missing[:5]}, unexpected {unexpected[:5]})."
            " Build every parameter in __init__ or configure_model from the constructor arguments only."
        )


def merge_anchors(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The strategy's anchors (see :class:`~lightning_dist.verification.recorder.VerifyRecorder`) from its ranks'
    records, whole: each name from the first rank that holds it (a pipeline rank holds its stages' names only)."""
    merged: dict[str, dict[str, Any]] = {}
    for record in records:
        for moment, state in record.get("anchors", {}).items():
            into = merged.setdefault(moment, {"params": {}, "optimizers": [{} for _ in state["optimizers"]]})
            for name, tensor in state["params"].items():
                into["params"].setdefault(name, tensor)
            for mine, theirs in zip(into["optimizers"], state["optimizers"]):
                for name, values in theirs.items():
                    mine.setdefault(name, values)
    return merged


def load_training_state(module: nn.Module, optimizers: list[Optimizer], state: dict[str, Any]) -> None:
    """Copy ``state``'s whole ``params`` and ``optimizers`` states by user name (as :func:`full_parameters` and
    :func:`full_optimizer_state` give them) into an unsharded ``module`` and its ``optimizers``, in place."""
    named, params = list(_named_parameters(module)), state["params"]
    with torch.no_grad():
        for name, param in named:
            value = params.get(user_name(name))
            if value is not None:
                param.copy_(value)
        for optimizer, states in zip(optimizers, state["optimizers"]):
            for name, param in named:
                own, values = optimizer.state.get(param), states.get(user_name(name))
                for key, value in (values or {}).items() if own else ():
                    current = own.get(key)
                    if isinstance(current, Tensor):
                        current.copy_(value) if isinstance(value, Tensor) else current.fill_(value)
                    elif isinstance(current, (int, float)):
                        own[key] = type(current)(value)


def start_from_initial_weights(module: nn.Module, path: Path) -> None:
    """Load the strategy's ``initial_weights`` (pretrained files, or the model weights of one of our checkpoints) into
    the whole ``module``, in this process, as the strategy loads them into its shards; the state the files do not
    hold (a new head) keeps the module's own init."""
    from lightning_dist.checkpoint.model_state import load_checkpoint_into
    from lightning_dist.checkpoint.pretrained import load_pretrained
    from lightning_dist.strategies.lifecycle.initial_weights import is_training_checkpoint

    if is_training_checkpoint(path):
        load_checkpoint_into(path, module, [], True, weights_only=True)
    else:
        load_pretrained(module, path)


def initial_state(module: nn.Module) -> dict[str, Tensor]:
    """The parameters and buffers of an unparallelized ``module``, as CPU copies (for :func:`load_initial_weights`)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items() if isinstance(v, Tensor)}


__all__ = [
    "full_gradients",
    "full_optimizer_state",
    "full_parameters",
    "initial_state",
    "load_initial_weights",
    "start_from_initial_weights",
    "load_training_state",
    "merge_anchors",
    "user_name",
    "zero_dropout",
]
