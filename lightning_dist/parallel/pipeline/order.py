"""The order in which a model's forward first runs its modules, found on a parameter-free meta-device copy.

Registration order (``named_children``) is not the forward's order: litgpt's ``GPT`` registers ``lm_head`` before
``transformer``. Everything the pipeline decides by order (which units are "before the blocks", where a stage
begins, which copy of a tied weight comes first) therefore asks :func:`forward_order` first. It runs the forward
once on a deep copy whose parameters and buffers are on the meta device (no memory, no compute) with an example
batch of token ids, and records each unit's first call with forward pre-hooks. A forward that cannot run that way
(it takes float features, or branches on tensor values) keeps registration order.

Meta copies run outside any fake tensor mode (:func:`on_meta`): a dry run's would turn every meta tensor into a fake
one at each op, which took three times as long as the forward itself (3.1 s against 0.8 s for 126 Llama blocks).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_dist.compat import real_tensors_temporarily
from lightning_dist.parallel.expert_parallel.apply import expert_parallel_state
from lightning_dist.parallel.expert_parallel.structure import find_expert_layers

# Sequence lengths tried for the example token ids: short (cheap, and below any model's maximum), then one token.
_EXAMPLE_LENGTHS = (8, 1)


def meta_twin(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on the meta device (no storage is copied).

    Mixture-of-experts layers compute shapes only in the copy (their output is shaped like their input): their
    kernels cannot run on meta (transformers' grouped-mm meta kernel takes bf16 only, its eager loop and litgpt's
    ``LLaMAMoE`` call ``nonzero``), which made an fp32 Mixtral and litgpt's MoE crash under the pipeline.
    """
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        )
    twin = copy.deepcopy(module, memo)
    for layer in find_expert_layers(twin):
        if layer.kind == "stacked":
            layer.experts.forward = _shaped_like_input
        else:  # routing and the expert loop in one forward (litgpt's LLaMAMoE): the whole layer is data-dependent
            twin.get_submodule(layer.name.rpartition(".")[0]).forward = _shaped_like_input
    for layer in twin.modules():
        if expert_parallel_state(layer) is not None and not hasattr(layer, "gate_up_proj"):
            layer.forward = _shaped_like_input  # a ModuleList MoE layer expert parallelism already split
    return twin


@contextmanager
def on_meta(grad: bool = False) -> Iterator[None]:
    """Where a meta copy runs: outside any fake tensor mode (meta tensors need none), without autograd unless
    ``grad``."""
    with real_tensors_temporarily(), torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        yield


def _shaped_like_input(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A mixture-of-experts computation's output on meta: shaped like its input (a stacked experts module's
    ``(tokens, hidden)``, a ``ModuleList`` MoE layer's ``(batch, sequence, hidden)``)."""
    return torch.empty_like(hidden_states)


def forward_order(
    model: nn.Module, names: Sequence[str], example: tuple[tuple, dict[str, Any]] | None = None
) -> list[str] | None:
    """``names`` (qualified submodule names of ``model``) sorted by when ``model``'s forward first calls them.

    Modules the forward never calls keep their place after the called ones, in the given order.

    Args:
        model: Any model, on any device (it is not run: a meta copy is).
        names: The submodules to order.
        example: ``(args, kwargs)`` of one forward call (tensors are moved to meta). Default: token ids
            ``[1, 8]`` (then ``[1, 1]``) as the forward's first argument.

    Returns:
        The names in forward order, or ``None`` when no example forward ran on the meta copy.
    """
    if example is not None:
        return _forward_order(model, names, example)
    # asked again of the same unchanged model (the checks before launch, then the cut): answered from the first run
    structure = (tuple(names), tuple(map(id, model.modules())))
    known = _ORDERS.get(model)
    if known is None or known[0] != structure:
        known = _ORDERS[model] = (structure, _forward_order(model, names, None))
    return None if known[1] is None else list(known[1])


_ORDERS: weakref.WeakKeyDictionary[nn.Module, tuple[Any, list[str] | None]] = weakref.WeakKeyDictionary()


def _forward_order(
    model: nn.Module, names: Sequence[str], example: tuple[tuple, dict[str, Any]] | None
) -> list[str] | None:
    try:
        twin = meta_twin(model)
    except Exception:  # noqa: BLE001 (a model that cannot be deep-copied keeps registration order)
        return None
    seen: list[str] = []

    def recorder(name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if name not in seen:
                seen.append(name)

        return hook

    handles = [twin.get_submodule(n).register_forward_pre_hook(recorder(n)) for n in names]
    try:
        for args, kwargs in [example] if example is not None else _token_examples(model):
            seen.clear()
            try:
                with on_meta():
                    twin(*_to_meta(args), **_to_meta(kwargs))
            except Exception:  # noqa: BLE001, S112 (this example does not fit the forward: try the next)
                continue
            return seen + [n for n in names if n not in seen]
        return None
    finally:
        for handle in handles:
            handle.remove()


def _token_examples(model: nn.Module) -> list[tuple[tuple, dict[str, Any]]]:
    """Token-id batches for the forward's first argument (the ``input_ids``/``idx`` of causal LMs)."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    first = next((p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
    if first is None:
        return []
    return [((), {first.name: torch.zeros(1, n, dtype=torch.long, device="meta")}) for n in _EXAMPLE_LENGTHS]


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value
