"""Checkpoints keep a fused projection's original row order although tensor parallelism permutes it.

Sharding a ``[Q | K | V]`` projection by heads permutes its rows into rank order (see
:mod:`lightning_dist.parallel.tensor_parallel.fused`). The permutation is undone at the state-dict boundary:

- the module's ``state_dict()`` returns the parameter in the original order, and ``load_state_dict()`` takes the
  original order and permutes it again (module hooks, installed when the rows are permuted; torch's
  ``get_model_state_dict``/``set_model_state_dict`` and so DCP go through them);
- an optimizer's state (Adam's moments have the parameter's layout) gets the same treatment from optimizer hooks
  (:func:`install_optimizer_layout_hooks`). They are installed on an optimizer at its first ``step()`` (a global
  step pre-hook, registered when the first rows are permuted), which comes before any state dict of it can be
  taken: torch's ``get_optimizer_state_dict`` itself steps an optimizer that has no state yet. A strategy may also
  call the function directly once its optimizers exist; it is idempotent.

Why not DTensor's ``_StridedShard`` placement, which could describe the interleaved shard without a permutation:
``torch.distributed.checkpoint`` (torch 2.13) writes a DTensor's local shard as one chunk at its first global offset,
which is wrong for a shard made of three pieces; FSDP2 would also stack its own placement on top of it. A permuted
tensor is an ordinary ``Shard(0)`` DTensor that DCP, FSDP2 and resharding handle as they do any other.

Converting one tensor costs one all-gather of that parameter (the full tensor is rebuilt on every rank, permuted and
re-split without further communication): it happens only when a state dict is taken or loaded.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook

_ROW_ORDERS = "_lightning_dist_row_orders"  # module attribute: parameter name → (dim, order)
_HOOKED = "_lightning_dist_layout_hooked"  # optimizer attribute: its layout hooks are decided
_PERMUTED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_GLOBAL_HOOK: list[Any] = []


def record_row_order(module: nn.Module, pname: str, dim: int, order: Tensor) -> None:
    """Remember that ``module.<pname>`` holds ``original.index_select(dim, order)``; installs the module's
    state-dict hooks the first time."""
    orders: dict[str, tuple[int, Tensor]] | None = getattr(module, _ROW_ORDERS, None)
    if orders is None:
        orders = {}
        object.__setattr__(module, _ROW_ORDERS, orders)
        module.register_state_dict_post_hook(_restore_in_state_dict)
        module.register_load_state_dict_pre_hook(_permute_on_load)
        _PERMUTED_MODULES.add(module)
        if not _GLOBAL_HOOK:
            _GLOBAL_HOOK.append(register_optimizer_step_pre_hook(_hook_at_first_step))
    orders[pname] = (dim, order.cpu())


def copy_row_orders(source: nn.Module, target: nn.Module) -> None:
    """Give ``target`` (a copy of ``source`` holding tensors of the same layout, such as an averaged copy) the
    row orders, and so the state-dict hooks, of ``source``'s own parameters."""
    for pname, (dim, order) in (getattr(source, _ROW_ORDERS, None) or {}).items():
        record_row_order(target, pname, dim, order)


def permuted_parameters(model: nn.Module) -> dict[str, tuple[nn.Parameter, int, Tensor]]:
    """Qualified name → (parameter, dim, order) of every parameter held in a permuted row order."""
    found: dict[str, tuple[nn.Parameter, int, Tensor]] = {}
    for name, module in model.named_modules():
        for pname, (dim, order) in (getattr(module, _ROW_ORDERS, None) or {}).items():
            found[f"{name}.{pname}" if name else pname] = (getattr(module, pname), dim, order)
    return found


def to_checkpoint_order(tensor: Tensor, dim: int, order: Tensor) -> Tensor:
    """The tensor in the original row order (same placements). Collective for a DTensor."""
    return _reorder(tensor, dim, torch.argsort(order))


def to_permuted_order(tensor: Tensor, dim: int, order: Tensor) -> Tensor:
    """The original-order ``tensor`` in the permuted row order (same placements). Collective for a DTensor."""
    return _reorder(tensor, dim, order)


def install_optimizer_layout_hooks(model: nn.Module | None, optimizer: Optimizer) -> int:
    """Make ``optimizer.state_dict()``/``load_state_dict()`` use the original row order for the states of permuted
    parameters (of ``model``; ``None``: of every live module). Idempotent: an optimizer is looked at once. Returns
    how many of its parameters are permuted."""
    if getattr(optimizer, _HOOKED, None) is not None:
        return getattr(optimizer, _HOOKED)
    modules = model.modules() if model is not None else list(_PERMUTED_MODULES)
    by_id = {
        id(getattr(module, pname)): (dim, order)
        for module in modules
        for pname, (dim, order) in (getattr(module, _ROW_ORDERS, None) or {}).items()
    }
    params = [p for group in optimizer.param_groups for p in group["params"]]
    # Optimizer.state_dict numbers parameters in param_groups order; load_state_dict maps them back the same way.
    orders = {index: by_id[id(p)] for index, p in enumerate(params) if id(p) in by_id}
    if orders:

        def restore(_: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
            return _convert_optimizer_state(state_dict, orders, to_checkpoint_order)

        def permute(_: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
            return _convert_optimizer_state(state_dict, orders, to_permuted_order)

        optimizer.register_state_dict_post_hook(restore)
        optimizer.register_load_state_dict_pre_hook(permute)
    object.__setattr__(optimizer, _HOOKED, len(orders))
    return len(orders)


def _hook_at_first_step(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(optimizer, _HOOKED, None) is None:
        install_optimizer_layout_hooks(None, optimizer)


def _convert_optimizer_state(
    state_dict: dict[str, Any], orders: dict[int, tuple[int, Tensor]], convert: Any
) -> dict[str, Any]:
    """Convert the states of the parameters at ``orders``' positions. A state dict names parameters by whatever ids
    its ``param_groups`` list (positions from ``Optimizer.state_dict``, names from torch's ``set_optimizer_state_dict``);
    the k-th id listed belongs to the optimizer's k-th parameter either way."""
    state = dict(state_dict["state"])  # the inner dicts are the optimizer's live state: never mutate them
    ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
    for position, (dim, order) in orders.items():
        pid = ids[position] if position < len(ids) else None
        if pid in state:
            state[pid] = {
                key: convert(value, dim, order) if _has_rows(value, dim, order) else value
                for key, value in state[pid].items()
            }
    return {**state_dict, "state": state}


def _has_rows(value: Any, dim: int, order: Tensor) -> bool:
    return isinstance(value, Tensor) and value.dim() > dim and value.shape[dim] == order.numel()


def _restore_in_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, _: Any) -> None:
    for pname, (dim, order) in getattr(module, _ROW_ORDERS).items():
        key = prefix + pname
        if key in state_dict and _has_rows(state_dict[key], dim, order):
            state_dict[key] = to_checkpoint_order(state_dict[key], dim, order)


def _permute_on_load(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    for pname, (dim, order) in getattr(module, _ROW_ORDERS).items():
        key = prefix + pname
        if key in state_dict and _has_rows(state_dict[key], dim, order):
            state_dict[key] = to_permuted_order(state_dict[key], dim, order)


def _reorder(tensor: Tensor, dim: int, index: Tensor) -> Tensor:
    if not isinstance(tensor, DTensor):
        return tensor.index_select(dim, index.to(tensor.device))
    full = tensor.full_tensor()
    reordered = full.index_select(dim, index.to(full.device))
    # Every rank holds the same full tensor: each keeps its own shard, no further communication.
    return distribute_tensor(reordered, tensor.device_mesh, tensor.placements, src_data_rank=None)
