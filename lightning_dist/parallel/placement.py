"""Where a parallelized model's state lives: materializing meta tensors and moving state to the training device.

Without offload everything goes to the training device. With FSDP2 CPU offload (``CPUOffloadPolicy``) the sharded
parameters, their gradients and the optimizer state stay in (pinned) CPU memory and the optimizer step runs on the
CPU; FSDP2 copies a unit's parameters to the device only for its forward and backward, and refuses to start if a
sharded parameter is anywhere but the CPU. Buffers are not sharded or offloaded: they go to the device, and so does
every submodule without parameters (a torchmetrics ``Metric`` keeps its states as plain attributes that only its own
``to()`` moves).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dist.compat import buffer_registry

_CPU = torch.device("cpu")


def planned_devices(model: nn.Module, device: torch.device, offload_parameters: bool) -> dict[str, torch.device]:
    """The device each parameter and buffer of ``model`` (by qualified name) must end up on."""
    param_device = _CPU if offload_parameters else device
    plan = {name: param_device for name, _ in model.named_parameters()}
    plan.update({name: device for name, _ in model.named_buffers()})
    return plan


def place_model(model: nn.Module, device: torch.device, offload_parameters: bool) -> None:
    """Move every parameter and buffer of a (materialized) model to its :func:`planned_devices` device.

    Under offload only buffers move: FSDP2 has already put its sharded parameters in CPU memory, and moving them
    with ``model.to(device)`` is what made it refuse to start.
    """
    if not offload_parameters:
        if any(t.device != device for t in (*model.parameters(), *model.buffers())):
            model.to(device)
        return
    for module in _parameter_free_subtrees(model):
        module.to(device)
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.device != device:
                buffer_registry(module)[name] = buffer.to(device)


def _parameter_free_subtrees(model: nn.Module) -> list[nn.Module]:
    """The largest submodules of ``model`` that hold no parameter (``model`` itself excluded)."""
    found: list[nn.Module] = []
    for child in model.children():
        if next(child.parameters(), None) is None:
            found.append(child)
        else:
            found.extend(_parameter_free_subtrees(child))
    return found
