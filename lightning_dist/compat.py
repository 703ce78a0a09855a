"""Every private torch API lightning_dist relies on, in one place, with the torch versions it was tested against.

Public torch APIs are used directly everywhere else. What is here may change in any torch release: when a new one
breaks something, this file is where it gets fixed, and :data:`TESTED_TORCH` is where the new version is added once
the suite passes on it. Importing the package warns once on a torch newer than the newest tested one.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # base of profiling's CommCounter

__all__ = [
    "TESTED_TORCH",
    "TorchDispatchMode",
    "aten_attention_op",
    "compile_like",
    "compile_mode_names",
    "compiled_module_class",
    "composable_checkpoint",
    "current_dispatch_mode",
    "flatten_mesh",
    "fsdp_collective_protocols",
    "fully_shard_module",
    "gather_full_state",
    "is_compiled_in_place",
    "load_dcp_without_process_group",
    "load_functional_collectives",
    "registered_process_groups",
    "resolve_process_group",
    "sdpa_builtin_home",
    "torch_minor_version",
    "unflatten_mesh",
    "untested_torch_message",
    "warn_if_untested_torch",
]

# Minor versions of torch the whole suite has passed on (CPU/gloo; CUDA where stated in the README).
TESTED_TORCH: tuple[tuple[int, int], ...] = ((2, 13), (2, 14))


def torch_minor_version(version: str = torch.__version__) -> tuple[int, int]:
    """``"2.14.1+cu130"`` → ``(2, 14)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def untested_torch_message(version: str = torch.__version__) -> str | None:
    """A warning text when ``version`` is newer than every tested torch, else ``None``."""
    if torch_minor_version(version) <= max(TESTED_TORCH):
        return None
    newest = ".".join(map(str, max(TESTED_TORCH)))
    return (
        f"lightning_dist was tested with torch up to {newest}; torch {version} may have changed the private APIs it"
        " uses (all listed in lightning_dist/compat.py). Please report anything that breaks."
    )


def warn_if_untested_torch() -> None:
    if (message := untested_torch_message()) is not None:
        warnings.warn(message, UserWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------------- DeviceMesh
def flatten_mesh(mesh: Any, name: str) -> Any:
    """One 1-D mesh over all dims of ``mesh`` (``DeviceMesh._flatten``)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: Any, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """Split dim ``dim`` of ``mesh`` into named dims of ``sizes`` (``DeviceMesh._unflatten``)."""
    return mesh._unflatten(dim, sizes, names)


def registered_process_groups() -> list[Any]:
    """Every process group ``torch.distributed`` knows in this process (``_world.pg_map``), the default included."""
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


# ---------------------------------------------------------------------------------------------------- FSDP2
def fsdp_collective_protocols() -> tuple[type, type]:
    """The ``AllGather`` and ``ReduceScatter`` protocols of FSDP2's custom collectives."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def fully_shard_module() -> ModuleType:
    """The module implementing ``fully_shard`` (holds ``_get_post_forward_mesh_info``)."""
    from torch.distributed.fsdp._fully_shard import _fully_shard

    return _fully_shard


# ---------------------------------------------------------------------------------------------------- torch.compile
def compiled_module_class() -> type[torch.nn.Module]:
    """The wrapper class ``torch.compile(module)`` returns (it holds the module as ``_orig_mod``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule


def compile_mode_names() -> list[str]:
    """The ``mode=`` values ``torch.compile`` accepts (inductor's list)."""
    from torch._inductor import list_mode_options

    return list(list_mode_options())


def compile_like(wrapper: torch.nn.Module, module: torch.nn.Module) -> None:
    """Compile ``module`` in place with the settings (backend, mode, options) of ``wrapper``, a
    ``torch.compile(module)`` result: what ``module.compile(...)`` does with the same arguments."""
    dynamo_ctx = getattr(wrapper, "dynamo_ctx", None)
    if dynamo_ctx is None:  # a torch without the attribute: the defaults
        module.compile()
    else:
        module._compiled_call_impl = dynamo_ctx(module._call_impl)


def is_compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` was called on ``module``."""
    return getattr(module, "_compiled_call_impl", None) is not None


# ---------------------------------------------------------------------------------------------------- activation checkpointing
def composable_checkpoint(module: torch.nn.Module) -> torch.nn.Module:
    """Hook-based activation checkpointing that keeps parameter names (``torch.distributed._composable``)."""
    from torch.distributed._composable import checkpoint

    return checkpoint(module)


# ---------------------------------------------------------------------------------------------------- DCP
def load_dcp_without_process_group(reader: Any, planner_mixin: type | None = None) -> dict[str, Any]:
    """Every tensor of a DCP checkpoint folder (through its storage ``reader``), in full, in this process (no process
    group needed). ``planner_mixin`` overrides methods of DCP's planner (a restricted ``load_bytes``)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    planner_cls = _EmptyStateDictLoadPlanner
    if planner_mixin is not None:
        planner_cls = type(f"{planner_mixin.__name__}EmptyStateDict", (planner_mixin, _EmptyStateDictLoadPlanner), {})
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=planner_cls(), no_dist=True)
    return state


def gather_full_state(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Every DTensor of ``state`` gathered in full onto the CPU of global rank ``rank`` (empty on the others).
    Collective over the tensors' meshes; ``get_model_state_dict``'s public options only gather onto rank 0."""
    from torch.distributed._state_dict_utils import _gather_state_dict

    return _gather_state_dict(state, cpu_offload=True, ranks_only=(rank,))


# ---------------------------------------------------------------------------------------------------- c10d and dispatch
def resolve_process_group(name: str) -> Any:
    """The ``ProcessGroup`` a functional collective names by string."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def default_store() -> Any:
    """The rendezvous store of the default process group (``None`` without one)."""
    from torch.distributed.distributed_c10d import _get_default_store

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return _get_default_store()


def abort_process_groups() -> bool:
    """Abort every process group so that collectives blocked in them raise (NCCL only); whether it was done."""
    from torch.distributed.distributed_c10d import _abort_process_group

    try:
        _abort_process_group()
    except Exception:  # noqa: BLE001 (a backend that cannot abort)
        return False
    return True


def current_dispatch_mode() -> Any:
    """The innermost active ``TorchDispatchMode`` (or ``None``)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


def load_functional_collectives() -> None:
    """Import the module that registers ``torch.ops._c10d_functional`` (DTensor's collectives)."""
    import torch.distributed._functional_collectives  # noqa: F401


# ---------------------------------------------------------------------------------------------------- attention kernels
def sdpa_builtin_home() -> ModuleType:
    """The C module whose ``scaled_dot_product_attention`` builtin ``F.scaled_dot_product_attention`` is."""
    return torch._C._nn


def aten_attention_op(name: str) -> Any:
    """A fused attention kernel or its backward, e.g. ``"_scaled_dot_product_flash_attention_for_cpu"``."""
    return getattr(torch.ops.aten, name).default
