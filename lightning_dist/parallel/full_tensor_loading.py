"""``module.load_state_dict(full_state_dict)`` into a parallelized module.

After sharding, parameters are DTensors, and ``load_state_dict`` of the whole tensors a user (or a library: litgpt's
``load_checkpoint``) read with ``torch.load`` fails copying a plain tensor into a DTensor. A load pre-hook on the root
turns each whole tensor aimed at a DTensor into that DTensor's local part: every rank holds the whole tensor, so each
keeps its own slice (``distribute_tensor(..., src_data_rank=None)``, no communication). Row orders of fused
projections under tensor parallelism are applied after it by their own hooks (:mod:`.tensor_parallel.checkpoint_layout`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.hooks import RemovableHandle

from lightning_dist.compat.torch import non_persistent_buffer_names


def accept_full_tensors(root: nn.Module) -> list[RemovableHandle]:
    """Let ``root.load_state_dict`` take whole tensors for its sharded parameters and buffers. Each module converts
    its own entries, inside its own load: a library's module may rename keys on the way (litgpt's LoRA layers map
    ``qkv.weight`` to ``qkv.linear.weight``)."""
    return [module.register_load_state_dict_pre_hook(_local_parts_of_full_tensors) for module in root.modules()]


def _local_parts_of_full_tensors(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    skipped = non_persistent_buffer_names(module)
    own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    for name, target in own:
        if name in skipped or not isinstance(target, DTensor):
            continue
        value = _tensor(state_dict.get(prefix + name))
        if value is None:
            continue
        if not isinstance(value, DTensor) and value.shape == target.shape:  # else load_state_dict reports it
            whole = value.detach().to(target.device)
            state_dict[prefix + name] = distribute_tensor(
                whole, target.device_mesh, target.placements, src_data_rank=None
            )


def _tensor(value: Any) -> Tensor | None:
    """``value`` as a tensor: itself, or a lazily read one (Lightning's ``lazy_load``, which litgpt's
    ``load_checkpoint`` uses, gives objects that read their bytes on first use) read now; ``None`` for anything else."""
    if isinstance(value, Tensor):
        return value
    if hasattr(value, "shape") and callable(getattr(value, "contiguous", None)):
        read = value.contiguous()
        return read if isinstance(read, Tensor) else None
    return None
