"""A meta-device model's state created where it will live, and initialized as the model's own constructor would.

``Trainer.init_module(empty_init=True)`` builds the model on the meta device; once it is parallelized,
:func:`materialize` creates every tensor on the device (``to_empty``) and initializes it:

1. every floating-point tensor is filled with NaN, so that state no initializer reaches is found (and never trains
   from whatever the memory held);
2. weights tied in the model (the same parameter in two modules: GPT-2's ``lm_head`` and ``wte``) are tied again,
   since ``to_empty`` gave each module a tensor of its own;
3. every module with a ``reset_parameters()`` runs it, as Lightning does and as torch modules do in their constructor;
4. every Hugging Face ``PreTrainedModel`` runs its own weight initialization (``initialize_weights``), as its
   constructor does after building the modules and as ``from_pretrained`` does for weights a checkpoint lacks. It
   covers modules without ``reset_parameters``: RMSNorm weights (ones), GPT-2's ``Conv1D``, MoE experts and routers,
   and the rotary ``inv_freq``, a non-persistent buffer (in no checkpoint) recomputed from the config;
5. every PEFT LoRA adapter gets PEFT's own initialization again (``lora_B`` zero: the wrapped model computes what
   the model it wraps does), since steps 3 and 4 drew into its ``lora_A`` and ``lora_B`` as into any linear layer;
6. embedding padding rows are zeroed on the rank that holds them (``weight[padding_idx].zero_()``, what
   ``nn.Embedding`` and transformers both do, writes into a copy when the weight is a sharded DTensor).

What each rank then holds: values that do not depend on random draws (norm weights, biases, ``inv_freq``, padding
rows) are one process's, each rank holding its slice. Random draws have the distribution one process draws from, not
its numbers (the constructor drew them in another order, before any sharding). On CUDA, DTensor's random number
generator gives every shard draws of its own; on the CPU, torch draws the same numbers for every rank's shard, so
each rank draws from a generator seeded with the current seed plus its rank (the generator is restored afterwards:
training draws what it would have drawn). Copies that must be equal (replicated over tp or dp_replicate) are made
equal afterwards by the strategy's replicated-state broadcast.

Pure PyTorch, no Lightning.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_dist.compat import is_fake_tensor, non_persistent_buffer_names
from lightning_dist.compat.hugging_face import initialize_pretrained_weights, pretrained_models
from lightning_dist.compat.peft import initialize_lora_adapters


@dataclass(frozen=True)
class Materialized:
    """What :func:`materialize` initialized, and what nothing initialized.

    Attributes:
        reset_modules: How many modules ran their ``reset_parameters()``.
        pretrained: The class names of the Hugging Face models initialized with their own weight init.
        uninitialized: Floating-point parameters and persistent buffers (qualified names) still NaN: a checkpoint
            loaded before the first step may fill them.
        lost_buffers: Non-persistent floating-point buffers still NaN: no checkpoint holds them.
        classes: The module class holding each name of ``uninitialized`` and ``lost_buffers``.
    """

    reset_modules: int
    pretrained: tuple[str, ...]
    uninitialized: tuple[str, ...]
    lost_buffers: tuple[str, ...]
    classes: dict[str, str]


def has_meta_state(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def materialize(model: nn.Module, device: torch.device, rank: int = 0) -> Materialized | None:
    """Create ``model``'s state on ``device`` and initialize it (see the module docstring); ``None`` when nothing
    was on the meta device. ``rank``: the global rank, which seeds the CPU draws."""
    if not has_meta_state(model):
        return None
    ties = _tied_parameters(model)
    model.to_empty(device=device)  # on the root: FSDP2 re-registers its sharded parameters there
    with torch.no_grad():
        for tensor in _floating_state(model):
            tensor.fill_(float("nan"))
        _tie_again(ties)
        with _draws_of_this_rank(device, rank):
            reset = _reset_parameters(model)
            pretrained = pretrained_models(model)
            for pretrained_model in pretrained:
                initialize_pretrained_weights(pretrained_model)
            initialize_lora_adapters(model)  # after the model's init, which drew into the adapters' linears too
        _tie_again(ties)  # a model's init may have re-tied on its own: keep the first holder's tensor
        _zero_padding_rows(model)
    uninitialized, lost, classes = _still_nan(model)
    return Materialized(
        reset_modules=reset,
        pretrained=tuple(type(m).__name__ for m in pretrained),
        uninitialized=uninitialized,
        lost_buffers=lost,
        classes=classes,
    )


def on_every_rank(materialized: Materialized) -> Materialized:
    """``materialized`` with what nothing initialized joined over every rank (each checked its own shards and
    stages), names sorted. Collective when a process group of more than one rank exists."""
    lost, uninitialized = set(materialized.lost_buffers), set(materialized.uninitialized)
    classes = dict(materialized.classes)
    if dist.is_initialized() and dist.get_world_size() > 1:
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (materialized.lost_buffers, materialized.uninitialized, materialized.classes))
        for rank_lost, rank_uninitialized, rank_classes in reports:
            lost.update(rank_lost)
            uninitialized.update(rank_uninitialized)
            classes.update(rank_classes)
    return Materialized(materialized.reset_modules, materialized.pretrained, tuple(sorted(uninitialized)),
                        tuple(sorted(lost)), classes)  # fmt: skip


def never_initialized_buffers(model: nn.Module) -> dict[str, str]:
    """Non-persistent floating-point buffers on the meta device that :func:`materialize` cannot initialize, by
    qualified name, with their module's class: their module has no ``reset_parameters()``, is in no Hugging Face
    model, and no module above it has a ``reset_parameters()`` of its own that might set them. No checkpoint holds
    them either, so they would stay NaN. (What a ``reset_parameters()`` above leaves out shows after materializing.)"""
    covered = {id(m) for pretrained in pretrained_models(model) for m in pretrained.modules()}
    found: dict[str, str] = {}

    def visit(module: nn.Module, prefix: str, reset_above: bool) -> None:
        if id(module) in covered:
            return
        resets = reset_above or (callable(getattr(module, "reset_parameters", None)) and _has_own_state(module))
        if not resets:
            transient = non_persistent_buffer_names(module)
            for name, buffer in module.named_buffers(recurse=False):
                if name in transient and buffer.is_meta and buffer.is_floating_point():
                    found[prefix + name] = _class_name(module)
        for child_name, child in module.named_children():
            visit(child, f"{prefix}{child_name}.", resets)

    visit(model, "", False)
    return found


def describe_names(names: Sequence[str], classes: dict[str, str], limit: int = 6) -> str:
    """``rotary.inv_freq (RotaryEmbedding), ...``, at most ``limit`` names."""
    shown = [f"{name} ({classes[name]})" if name in classes else name for name in names[:limit]]
    more = f", … ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(shown) + more


def never_initialized_message(names: Sequence[str], classes: dict[str, str]) -> str:
    """The refusal of non-persistent buffers nothing initializes after materializing."""
    owners = sorted({classes[name] for name in names if name in classes})
    return (
        f"Trainer.init_module(empty_init=True) built {describe_names(names, classes)} on the meta device, and nothing"
        " would give them values after materializing: they are non-persistent buffers (computed in the constructor,"
        f" in no checkpoint), and {', '.join(owners)} has no reset_parameters() and is not part of a Hugging Face"
        f" model (whose own init would recompute them). Give {', '.join(owners)} a reset_parameters() that computes"
        " them (it runs after materializing, on the device), or build the model without empty_init=True."
    )


def uninitialized_message(names: Sequence[str], classes: dict[str, str]) -> str:
    """The warning about parameters and persistent buffers nothing initialized after materializing."""
    owners = sorted({classes[name] for name in names if name in classes})
    return (
        f"Trainer.init_module(empty_init=True): {describe_names(names, classes)} have no values after materializing"
        f" (they hold NaN): {', '.join(owners)} has no reset_parameters() and no Hugging Face model's init covers"
        " it. Load them before the first step (a checkpoint: fit(ckpt_path=...)), give the module a"
        " reset_parameters(), or build the model without empty_init=True."
    )


def _class_name(module: nn.Module) -> str:
    """The module's own class name (not FSDP2's ``FSDP<name>`` subclass)."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed")).__name__


def _has_own_state(module: nn.Module) -> bool:
    return next(itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)), None) is not None


def _floating_state(model: nn.Module) -> list[Tensor]:
    tensors = {id(t): t for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()}
    return list(tensors.values())


_Holder = tuple[nn.Module, str]


def _tied_parameters(model: nn.Module) -> list[tuple[_Holder, list[_Holder]]]:
    """Each parameter held by several modules: its first holder (in module order, as FSDP2 records it) and the
    others."""
    holders: dict[int, list[_Holder]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(param), []).append((module, name))
    return [(found[0], found[1:]) for found in holders.values() if len(found) > 1]


def _tie_again(ties: list[tuple[_Holder, list[_Holder]]]) -> None:
    for (module, name), others in ties:
        param = getattr(module, name)
        for other, other_name in others:
            if getattr(other, other_name) is not param:
                setattr(other, other_name, param)


@contextmanager
def _draws_of_this_rank(device: torch.device, rank: int) -> Iterator[None]:
    """On the CPU, draws from a generator seeded with the current seed plus ``rank`` (restored on exit): DTensor's
    random ops would draw the same numbers for every rank's shard there. Elsewhere, nothing changes."""
    if device.type != "cpu":
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed((torch.initial_seed() + rank) % 2**63)  # the CPU's only
        yield


def _reset_parameters(model: nn.Module) -> int:
    count = 0
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset) and _has_own_state(module):
            reset()
            count += 1
    return count


def _zero_padding_rows(model: nn.Module) -> None:
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Embedding) or module.padding_idx is None or not isinstance(weight, DTensor):
            continue
        rows = torch.zeros(weight.shape[0], 1, dtype=torch.bool, device=weight.to_local().device)
        rows[module.padding_idx] = True
        mask = DTensor.from_local(rows, weight.device_mesh, [Replicate()] * weight.device_mesh.ndim, run_check=False)
        weight.masked_fill_(mask, 0.0)


_NAN_CHECK_CHUNK = 1 << 22  # elements: the check's boolean temporary stays this small, whatever the shard's size


def _has_nan(tensor: Tensor) -> Tensor:
    """Whether ``tensor`` holds a NaN, as a device boolean (no sync), checked chunk by chunk: ``isnan`` of a whole
    shard is a temporary the shard's size that the allocator keeps (0.02-0.08 GiB per rank measured on a 2 GB model
    at 4 ranks)."""
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    return torch.stack([chunk.isnan().any() for chunk in tensor.reshape(-1).split(_NAN_CHECK_CHUNK)]).any()


def _still_nan(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
    """The floating-point parameters and persistent buffers, then the non-persistent buffers, holding NaN on this
    rank (a rank checks its own shard), with the class of the module holding each."""
    entries: list[tuple[str, Tensor, bool, str]] = []  # name, tensor, whether a checkpoint can hold it, class
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        transient = non_persistent_buffer_names(module)
        own = [(n, t, True) for n, t in module.named_parameters(recurse=False)]
        own += [(n, t, n not in transient) for n, t in module.named_buffers(recurse=False)]
        for name, tensor, persistent in own:
            if id(tensor) in seen or not tensor.is_floating_point():
                continue
            seen.add(id(tensor))
            entries.append((prefix + name, tensor, persistent, _class_name(module)))
    if not entries:
        return (), (), {}
    local = [t.to_local() if isinstance(t, DTensor) else t for _, t, _, _ in entries]
    if any(is_fake_tensor(t) for t in local):  # a dry run: no values to check
        return (), (), {}
    flags = torch.stack([_has_nan(t) for t in local]).tolist()
    found = [(name, persistent, cls) for (name, _, persistent, cls), nan in zip(entries, flags) if nan]
    uninitialized = tuple(name for name, persistent, _ in found if persistent)
    lost = tuple(name for name, persistent, _ in found if not persistent)
    return uninitialized, lost, {name: cls for name, _, cls in found}
