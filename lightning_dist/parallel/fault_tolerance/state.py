"""What a healing replica group copies from a live one, rank by rank: this rank's shards of the parameters and
persistent buffers, the optimizers' states and hyperparameters, and entries the caller adds (a trainer's loop
counters and schedulers). Every tensor is a local shard (plain tensors travel; torchft's HTTP transport serves them
from the live group while it goes on with its forward pass), and loading copies into the live tensors in place, so
the healed group ends bitwise equal to its source.

The parameters are looked up once, at construction: reading ``module.state_dict()`` while another thread runs the
module's FSDP2 forward breaks it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_dist.compat import non_persistent_buffer_names
from lightning_dist.parallel.fault_tolerance.gradients import local_tensor


class ReplicaState:
    """The state of one rank of a replica group, for torchft's ``state_dict``/``load_state_dict`` callbacks.

    Args:
        module: The (parallelized) model.
        optimizers: A callable returning the optimizers (they may be created after this object).
        extra_state: Entries added to the state (Lightning's loops, schedulers); called when a peer heals.
        load_extra: Receives those entries when this group heals.
    """

    def __init__(
        self,
        module: Module,
        optimizers: Callable[[], list[Optimizer]],
        extra_state: Callable[[], dict[str, Any]] = dict,
        load_extra: Callable[[dict[str, Any]], None] = lambda extra: None,
    ) -> None:
        self.tensors: dict[str, Tensor] = dict(module.named_parameters())
        persistent = {name for name, _ in _persistent_buffers(module)}
        self.tensors.update({name: b for name, b in module.named_buffers() if name in persistent})
        self.optimizers = optimizers
        self.extra_state = extra_state
        self.load_extra = load_extra
        #: Bytes of tensors received by the last heal, and heals in this process.
        self.received_bytes = 0
        self.heals = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "tensors": {name: local_tensor(t).detach() for name, t in self.tensors.items()},
            "optimizers": [_optimizer_state(optimizer) for optimizer in self.optimizers()],
            "extra": self.extra_state(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = sorted(set(self.tensors) - set(state["tensors"]))
        if missing:
            raise RuntimeError(
                f"fault_tolerance: the live group sent no value for {missing[:5]}: the replica groups must train the"
                " same model with the same strategy options."
            )
        for name, tensor in self.tensors.items():
            local_tensor(tensor).copy_(state["tensors"][name])
        optimizers = self.optimizers()
        if len(optimizers) != len(state["optimizers"]):
            raise RuntimeError(
                f"fault_tolerance: the live group has {len(state['optimizers'])} optimizers, this one {len(optimizers)}."
            )
        for optimizer, saved in zip(optimizers, state["optimizers"]):
            _load_optimizer_state(optimizer, saved)
        self.load_extra(state["extra"])
        self.received_bytes = _tensor_bytes(state)
        self.heals += 1


def _persistent_buffers(module: Module) -> Iterator[tuple[str, Tensor]]:
    for prefix, child in module.named_modules():
        for name, buffer in child.named_buffers(recurse=False):
            if buffer is not None and name not in non_persistent_buffer_names(child):
                yield (f"{prefix}.{name}" if prefix else name), buffer


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_state(optimizer: Optimizer) -> dict[str, Any]:
    state = []
    for param in _params(optimizer):
        entries = optimizer.state.get(param, {})
        state.append({k: local_tensor(v).detach() if isinstance(v, Tensor) else v for k, v in entries.items()})
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"state": state, "groups": groups}


def _load_optimizer_state(optimizer: Optimizer, saved: dict[str, Any]) -> None:
    params = _params(optimizer)
    if len(params) != len(saved["state"]) or len(optimizer.param_groups) != len(saved["groups"]):
        raise RuntimeError(
            "fault_tolerance: the live group's optimizer has other parameter groups than this one: the replica"
            " groups must run the same configure_optimizers."
        )
    for group, values in zip(optimizer.param_groups, saved["groups"]):
        group.update(values)
    for param, entries in zip(params, saved["state"]):
        if not entries:
            optimizer.state.pop(param, None)
            continue
        live = optimizer.state.get(param, {})
        state = {}
        for key, value in entries.items():
            current = live.get(key)
            if isinstance(value, Tensor) and isinstance(current, Tensor) and _fits(current, value):
                local_tensor(current).copy_(value)
                state[key] = current
            elif isinstance(value, Tensor):
                state[key] = _like_parameter(value, param)
            else:
                state[key] = value
        optimizer.state[param] = state


def _fits(current: Tensor, value: Tensor) -> bool:
    local = local_tensor(current)
    return local.shape == value.shape and local.dtype == value.dtype


def _like_parameter(value: Tensor, param: Tensor) -> Tensor:
    """A received optimizer-state tensor as the optimizer keeps it: a DTensor laid out as its parameter when it has
    the shape of the parameter's shard (moments), else as it came (Adam's ``step``)."""
    local = local_tensor(param)
    if value.dim() == 0 or value.shape != local.shape:
        return value.clone()
    shard = value.to(device=local.device).clone()
    if isinstance(param, DTensor):
        return DTensor.from_local(shard, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return shard


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0
