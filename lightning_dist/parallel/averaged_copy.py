"""Averaged copies (EMA, SWA) of a parallelized model that hold only what this rank holds.

torch's ``AveragedModel``, and Lightning's ``WeightAveraging`` and ``StochasticWeightAveraging`` callbacks, deep-copy
the whole model before it is parallelized and then copy values between the copy and the model tensor by tensor.
After FSDP2 or tensor parallelism that fails (a plain tensor cannot take a DTensor's values: "mixed torch.Tensor and
DTensor"), after a pipeline cut the copy's parameters are not the stage's, and a full copy per rank would undo the
memory sharding saves.

:func:`sharded_copy` copies the parallelized model instead: the same module tree under the same names, each
parameter and buffer a clone of what this rank holds (a DTensor on the same mesh with the same placements, or the
plain tensor). It costs what the model's parameters and buffers cost on this rank. Copies between it and the
model go shard to shard, and its state dict has the model's keys and layouts (tensor parallel's fused row orders
included), so DCP saves and loads it as it does the model.

:class:`ShardedAveragedModel` is an ``AveragedModel`` over such a copy whose ``update_parameters`` averages each
rank's local tensors. EMA and SWA are elementwise, so each element gets the value one process computes; an
``avg_fn``/``multi_avg_fn`` of the user's must be elementwise too.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import AveragedModel, get_swa_avg_fn, get_swa_multi_avg_fn

from lightning_dist.compat import (
    buffer_registry,
    child_module_registry,
    foreach_kernel_device_types,
    non_persistent_buffer_names,
    parameter_registry,
)
from lightning_dist.compat.torchao import plain_tensor
from lightning_dist.parallel.tensor_parallel.checkpoint_layout import copy_row_orders


class ShardedCopy(nn.Module):
    """The root of a :func:`sharded_copy` (its submodules are plain ``nn.Module`` containers)."""


def sharded_copy(model: nn.Module, device: torch.device | str | None = None) -> ShardedCopy:
    """A copy of ``model``'s parameters and buffers as this rank holds them, under the same names.

    Args:
        model: The parallelized model (FSDP2 shards, tensor-parallel DTensors, a pipeline stage's modules...).
        device: Where the copy's tensors live; ``None``: where the model's do.

    Returns:
        A module tree with ``model``'s child names, in the same order, where each parameter (``requires_grad=False``)
        and buffer is a detached clone with the same layout; tensors and modules shared within ``model`` are shared
        within the copy, so ``parameters()``, ``buffers()`` and ``state_dict()`` list the same entries in the same
        order as ``model``'s. torchao's FP8 weight wrappers are left out (the copy holds the plain weight).
    """
    copies: dict[int, Tensor] = {}
    modules: dict[int, nn.Module] = {}

    def copy_tensor(tensor: Tensor, parameter: bool) -> Tensor:
        if id(tensor) not in copies:
            clone = _clone(tensor, device)
            copies[id(tensor)] = nn.Parameter(clone, requires_grad=False) if parameter else clone
        return copies[id(tensor)]

    def copy_module(module: nn.Module, root: bool) -> nn.Module:
        if id(module) in modules:
            return modules[id(module)]
        copy = ShardedCopy() if root else nn.Module()
        modules[id(module)] = copy
        for name, param in parameter_registry(module).items():
            copy.register_parameter(name, None if param is None else copy_tensor(param, parameter=True))
        skipped = non_persistent_buffer_names(module)
        for name, buffer in buffer_registry(module).items():
            value = None if buffer is None else copy_tensor(buffer, parameter=False)
            copy.register_buffer(name, value, persistent=name not in skipped)
        for name, child in child_module_registry(module).items():
            copy.add_module(name, None if child is None else copy_module(child, root=False))
        copy_row_orders(module, copy)
        return copy

    return copy_module(model, root=True)  # type: ignore[return-value]


def _clone(tensor: Tensor, device: torch.device | str | None) -> Tensor:
    tensor = plain_tensor(tensor).detach()
    if not isinstance(tensor, DTensor):
        return tensor.to(device, copy=True) if device is not None else tensor.clone()
    local = tensor.to_local()
    local = local.to(device, copy=True) if device is not None else local.clone()
    return DTensor.from_local(
        local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def local_tensor(tensor: Tensor) -> Tensor:
    """What this rank holds of ``tensor`` (a DTensor's local shard, a plain tensor itself), detached, without
    torchao's wrapper: writing into it writes into ``tensor``."""
    tensor = plain_tensor(tensor).detach()
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShardedAveragedModel(AveragedModel):
    """``AveragedModel`` over a :func:`sharded_copy`, averaging each rank's local tensors.

    ``update_parameters`` follows ``torch.optim.swa_utils.AveragedModel.update_parameters`` step for step: the first
    update copies, later ones apply ``multi_avg_fn`` per device and dtype, or ``avg_fn`` per tensor, or (neither
    given) the equal-weight average, with foreach kernels on the device types where torch uses them; buffers are
    averaged with ``use_buffers`` and copied otherwise.

    Args:
        module: The :func:`sharded_copy` of the model to average.
        avg_fn, multi_avg_fn, use_buffers: As for ``AveragedModel``.
    """

    def __init__(
        self,
        module: nn.Module,
        avg_fn: object = None,
        multi_avg_fn: object = None,
        use_buffers: bool = False,
    ) -> None:
        # torch's constructor checks the arguments and registers n_averaged; it deep-copies the module it is given,
        # so it gets an empty one and the copy, already made, is put in its place.
        super().__init__(nn.Module(), avg_fn=avg_fn, multi_avg_fn=multi_avg_fn, use_buffers=use_buffers)  # type: ignore[arg-type]
        self.module = module

    @classmethod
    def replacing(cls, averaged: AveragedModel, module: nn.Module) -> ShardedAveragedModel:
        """A model that averages like ``averaged`` (its functions, ``use_buffers`` and count) into ``module``."""
        new = cls(module, averaged.avg_fn, averaged.multi_avg_fn, averaged.use_buffers)
        count = averaged.n_averaged.detach()
        # A copy made on the meta device (of a model not materialized yet) has averaged nothing.
        new.n_averaged = torch.zeros_like(count, device="cpu") if count.is_meta else count.clone()
        return new

    @torch.no_grad()
    def update_parameters(self, model: nn.Module) -> None:
        averaged = [local_tensor(t) for t in _tensors(self.module, self.use_buffers)]
        current = [local_tensor(t) for t in _tensors(model, self.use_buffers)]
        _check_alike(averaged, current)
        current = [c.to(a.device) for a, c in zip(averaged, current)]
        if self.n_averaged == 0:
            for a, c in zip(averaged, current):
                a.copy_(c)
        elif self.multi_avg_fn is not None or self.avg_fn is None:
            groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = defaultdict(
                lambda: ([], [])
            )
            for a, c in zip(averaged, current):
                groups[(a.device, a.dtype)][0].append(a)
                groups[(a.device, a.dtype)][1].append(c)
            for (device, _), (a_group, c_group) in groups.items():
                count = self.n_averaged.to(device)
                if self.multi_avg_fn is not None:
                    self.multi_avg_fn(a_group, c_group, count)
                elif device.type in foreach_kernel_device_types():
                    get_swa_multi_avg_fn()(a_group, c_group, count)
                else:
                    swa = get_swa_avg_fn()
                    for a, c in zip(a_group, c_group):
                        a.copy_(swa(a, c, count))
        else:
            for a, c in zip(averaged, current):
                a.copy_(self.avg_fn(a, c, self.n_averaged.to(a.device)))
        if not self.use_buffers:
            for a, c in zip(self.module.buffers(), model.buffers(), strict=True):
                local_tensor(a).copy_(local_tensor(c).to(local_tensor(a).device))
        self.n_averaged += 1


def _tensors(module: nn.Module, use_buffers: bool) -> list[Tensor]:
    return [*module.parameters(), *(module.buffers() if use_buffers else ())]


def _check_alike(averaged: list[Tensor], current: list[Tensor]) -> None:
    if len(averaged) != len(current) or any(a.shape != c.shape for a, c in zip(averaged, current)):
        raise RuntimeError(
            "The averaged copy does not hold the model's tensors (different count or shapes on this rank): it was"
            " made from a differently parallelized model. Make the copy again from this model (sharded_copy)."
        )
