"""Every private torch API lightning_dist relies on, in one place, with the torch versions it was checked on.

Public torch APIs are used directly everywhere else (``tests/test_compat.py`` reads the package's syntax tree to keep
it so). What is here may change in any torch release: when a new one breaks something, this file is where it gets
fixed, and :data:`TESTED_TORCH` is where the new version is added once the suite passes on it. Importing the package
warns once on a torch newer than the newest tested one.

Each entry names the private torch name it wraps, the torch version it was checked on and who uses it.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from types import FrameType, ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 (re-exported: the base of CommCounter)

#: Every private torch name used below: ``name -> (checked on, used for)``. tests/test_compat.py checks the list is
#: complete; a new torch release is checked against it.
PRIVATE_TORCH_NAMES: dict[str, tuple[str, str]] = {
    "_python_dispatch": ("torch 2.13", "torch.utils._python_dispatch: TorchDispatchMode, base of CommCounter"),
    "_get_current_dispatch_mode": ("torch 2.13", "profiling: CommCounter checks it exits in order"),
    "_flatten": ("torch 2.13", "parallel/mesh.py: the flattened data-parallel and loss meshes"),
    "_module_classes": ("torch 2.13", "strategies/lightning_arguments.py: the classes of an FSDP1 ModuleWrapPolicy"),
    "_unflatten": ("torch 2.13", "parallel/mesh.py: hybrid shard's replicate x shard split"),
    "_world": ("torch 2.13", "runtime: destroy every registered process group at exit"),
    "_utils": (
        "torch 2.13",
        "checkpoint/pretrained: compute_local_shape_and_global_offset, the block of a DTensor a rank holds",
    ),
    "_current_frames": ("CPython 3.11", "runtime/activity.py: the main thread's frame (sys, not torch)"),
    "_fsdp_api": ("torch 2.13", "parallel/zeropp.py: FSDP2's AllGather/ReduceScatter protocols"),
    "_fully_shard": ("torch 2.13", "torch.distributed.fsdp._fully_shard(._fully_shard): FSDP2's implementation"),
    "_get_post_forward_mesh_info": ("torch 2.13", "parallel/fsdp.py: one post-forward mesh per int reshard size"),
    "_get_fsdp_state": ("torch 2.13", "parallel/fsdp.py: the FSDP2 state of a root module (manual backward)"),
    "_force_complete_incomplete_states": (
        "torch 2.13",
        "parallel/fsdp.py: FSDP2's end of the root's forward, run before a backward inside it",
    ),
    "_register_pre_backward_hook": ("torch 2.13", "parallel/fsdp.py: the root's pre-backward hook on a manual loss"),
    "_dynamo": ("torch 2.13", "parallel/compile.py: OptimizedModule, the torch.compile(module) wrapper"),
    "_orig_mod": ("torch 2.13", "parallel/compile.py: the module inside a torch.compile wrapper"),
    "_inductor": ("torch 2.13", "parallel/compile.py: the mode names torch.compile accepts"),
    "_call_impl": ("torch 2.13", "parallel/compile.py: compile a module in place like a wrapper"),
    "_compiled_call_impl": ("torch 2.13", "parallel/compile.py: whether module.compile() was called"),
    "_composable": ("torch 2.13", "parallel/activation_checkpointing.py: hook-based checkpoint"),
    "_EmptyStateDictLoadPlanner": ("torch 2.13", "checkpoint/consolidate.py: load a DCP folder in one process"),
    "_load_state_dict": ("torch 2.13", "checkpoint/consolidate.py: load a DCP folder without a process group"),
    "_state_dict_utils": ("torch 2.13", "checkpoint/model_state.py: gather onto any rank"),
    "_gather_state_dict": ("torch 2.13", "checkpoint/model_state.py: gather a full state onto one rank"),
    "_StorageInfo": ("torch 2.13", "checkpoint/safe_load.py: a class a DCP .metadata file pickles"),
    "_get_layout": ("torch 2.13", "checkpoint/safe_load.py: the layout lookup a DCP .metadata file pickles"),
    "_resolve_process_group": ("torch 2.13", "profiling: the group a functional collective names"),
    "_get_default_store": ("torch 2.13", "strategies/lifecycle/failure_handling.py: the rendezvous store"),
    "_abort_process_group": (
        "torch 2.13",
        "strategies/lifecycle/failure_handling.py: unblock collectives on a failure",
    ),
    "_functional_collectives": (
        "torch 2.13",
        "profiling: registers torch.ops._c10d_functional; expert_parallel: the all-to-all left in flight",
    ),
    "_c10d_functional": ("torch 2.13", "profiling: DTensor's functional collective ops, counted by CommCounter"),
    "_c10d_functional_autograd": ("torch 2.13", "profiling: the autograd variants of the functional collectives"),
    "_current_graph_task_id": ("torch 2.13", "profiling: whether the autograd engine runs a backward pass"),
    "_ops": ("torch 2.13", "profiling: HigherOrderOperator, passed through by CommCounter"),
    "_overloadpacket": ("torch 2.13", "profiling: the op family a dispatched op overload belongs to"),
    "_schema": ("torch 2.13", "profiling: an op's argument names and defaults"),
    "_C": ("torch 2.13", "the C extension: _current_graph_task_id, _nn (SDPA's builtin home)"),
    "_nn": ("torch 2.13", "context parallel: the C module of F.scaled_dot_product_attention's builtin"),
    "_buffers": ("torch 2.13", "nn.Module's buffer dict: rope tables read/swapped, buffers moved under offload"),
    "_modules": ("torch 2.13", "nn.Module's child dict: pipeline/stage.py's shell copies of container modules"),
    "_parameters": ("torch 2.13", "nn.Module's parameter dict: parallel/averaged_copy.py copies it name for name"),
    "_non_persistent_buffers_set": (
        "torch 2.13",
        "buffers no state dict holds: parallel/materialize.py, parallel/averaged_copy.py",
    ),
    "_foreach_utils": ("torch 2.13", "parallel/averaged_copy.py: where AveragedModel's default SWA uses foreach"),
    "_get_foreach_kernels_supported_devices": ("torch 2.13", "parallel/averaged_copy.py: as AveragedModel decides"),
    "_cdata": ("torch 2.13", "planning/model_facts.py: identity of a tensor storage"),
    "_foreach_norm": ("torch 2.13", "runtime/nonfinite.py: one fused norm per device for the non-finite check"),
    "_apply": ("torch 2.13", "tensor parallel: ParallelStyle's apply hook, run by our fused styles"),
    "_grouped_mm": ("torch 2.13", "expert parallel: grouped GEMM of the local experts on CUDA (older torch)"),
    "_pytree": (
        "torch 2.13",
        "dryrun, profiling/live_memory.py: tree_leaves, the tensors of an op's arguments",
    ),
    "_sharding_prop": ("torch 2.13", "profiling/live_memory.py: DTensor's shape propagation, not counted"),
    "_propagate_tensor_meta_non_cached": ("torch 2.13", "profiling/live_memory.py: DTensor's shape propagation"),
    "_subclasses": (
        "torch 2.13",
        "dryrun: FakeTensorMode, FakeTensor, is_fake, unset_fake_temporarily, in_kernel_invocation_manager",
    ),
    "_unsafe_view": ("torch 2.13", "dryrun: a reshape's view op that autograd does not track as one"),
    "_reshape_alias": ("torch 2.13", "dryrun: a reshape's view op (older decompositions)"),
    "_local_scalar_dense": ("torch 2.13", "dryrun: the op behind .item(), answered without data"),
    "_internal": ("torch 2.13", "dryrun: importing torch.testing._internal...fake_pg registers 'fake'"),
    "_is_any_true": ("torch 2.13", "parallel/dtensor_checks.py: anomaly detection's NaN test, given a DTensor rule"),
    "_is_all_true": ("torch 2.13", "parallel/dtensor_checks.py: torch._check's test, given a DTensor rule"),
    "_prepare_forward_infra": ("torch 2.13", "parallel/pipeline/runner.py: a stage's shape inference (first step)"),
    "_prepare_backward_infra": ("torch 2.13", "parallel/pipeline/runner.py: a stage's gradient shape inference"),
}

# Minor versions of torch the whole suite has passed on (CPU/gloo; CUDA where docs/testing.md or the GPU benchmark says so).
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
        " uses (all listed in lightning_dist/compat/). Please report anything that breaks."
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


# ---------------------------------------------------------------------------------------------------- nn.Module
def buffer_registry(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers by name, the dict itself (``nn.Module._buffers``): writing to it replaces a buffer
    without the checks of ``register_buffer``."""
    return module._buffers


def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """The names of ``module``'s own buffers registered with ``persistent=False`` (in no state dict, so in no
    checkpoint): ``nn.Module._non_persistent_buffers_set``."""
    return set(module._non_persistent_buffers_set)


def state_tensors(root: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``root``'s parameters and persistent buffers under their state-dict keys, read off the registries (a state
    dict would run its hooks: tensor parallel's reorder of fused projections)."""
    found: list[tuple[str, torch.Tensor]] = list(root.named_parameters(remove_duplicate=False))
    for module_name, module in root.named_modules():
        skipped = non_persistent_buffer_names(module)
        prefix = f"{module_name}." if module_name else ""
        found += [(prefix + name, b) for name, b in module.named_buffers(recurse=False) if name not in skipped]
    return found


def child_module_registry(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    """``module``'s direct children by name, the dict itself (``nn.Module._modules``)."""
    return module._modules


def parameter_registry(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """``module``'s own parameters by name, in registration order, the dict itself (``nn.Module._parameters``)."""
    return module._parameters


def foreach_kernel_device_types() -> list[str]:
    """The device types on which ``AveragedModel.update_parameters`` averages with foreach kernels by default
    (``torch.utils._foreach_utils._get_foreach_kernels_supported_devices``); elsewhere it averages tensor by tensor,
    which rounds differently."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return list(_get_foreach_kernels_supported_devices())


def storage_identity(tensor: torch.Tensor) -> int:
    """A number identifying the storage ``tensor`` views (``UntypedStorage._cdata``): equal for views of one
    storage."""
    return untyped_storage_identity(tensor.untyped_storage())


def untyped_storage_identity(storage: torch.UntypedStorage) -> int:
    """:func:`storage_identity` of a storage itself."""
    return storage._cdata


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The global offsets and the shape of the block of ``tensor`` this rank holds (the whole of a plain tensor).
    A ``ValueError`` for placements whose local part is not one block (``_StridedShard``)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    if any(placement.is_shard() and type(placement) is not Shard for placement in tensor.placements):
        raise ValueError(f"a DTensor placed {tensor.placements} holds more than one block on a rank")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(shape)


def foreach_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, fused into few kernels (``torch._foreach_norm``); the tensors share a device."""
    return list(torch._foreach_norm(list(tensors)))


# ---------------------------------------------------------------------------------------------------- tensor parallel
def apply_parallel_style(style: Any, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    """Shard ``module`` as the ``ParallelStyle`` ``style`` does (its ``_apply``): what ``parallelize_module`` calls,
    for a style run from inside our own style."""
    return style._apply(module, device_mesh)


# ---------------------------------------------------------------------------------------------------- FSDP2
def fsdp_collective_protocols() -> tuple[type, type]:
    """The ``AllGather`` and ``ReduceScatter`` protocols of FSDP2's custom collectives."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter


def fully_shard_module() -> ModuleType:
    """The module implementing ``fully_shard`` (holds ``_get_post_forward_mesh_info``)."""
    from torch.distributed.fsdp._fully_shard import _fully_shard

    return _fully_shard


@contextmanager
def replaced_post_forward_mesh_info(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[bool]:
    """Within it, FSDP2 computes each unit's post-forward mesh (``_fully_shard._get_post_forward_mesh_info``) with
    ``wrap(original)``; the original is back on exit. Yields whether it was replaced (``False``, changing nothing, on
    a torch without the function)."""
    impl = fully_shard_module()
    original = getattr(impl, "_get_post_forward_mesh_info", None)
    if original is None:
        yield False
        return
    impl._get_post_forward_mesh_info = wrap(original)
    try:
        yield True
    finally:
        impl._get_post_forward_mesh_info = original


def end_fsdp_forward_before_backward(root: torch.nn.Module, loss: torch.Tensor) -> None:
    """What FSDP2 does when its root module's forward returns, done on ``loss`` before a backward that starts while
    that forward still runs: every grouped unit (``fully_shard([a, b, ...])``) whose modules ran only in part is
    finished (``FSDPState._force_complete_incomplete_states``), and the root's pre-backward hook is registered on
    ``loss`` (``FSDPState._register_pre_backward_hook``), which queues the callback that reduce-scatters every unit's
    gradients at the end of the backward. Both register autograd hooks on ``loss`` in place."""
    state = root._get_fsdp_state()
    state._force_complete_incomplete_states(loss)
    state._register_pre_backward_hook(loss)


# ---------------------------------------------------------------------------------------------------- torch.compile
def compiled_inner_module(wrapper: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile(module)`` wrapper holds (``OptimizedModule._orig_mod``)."""
    return wrapper._orig_mod


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
def composable_checkpoint(module: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Hook-based activation checkpointing that keeps parameter names (``torch.distributed._composable``);
    ``options`` go to torch's non-reentrant checkpoint (``context_fn`` for selective checkpointing)."""
    from torch.distributed._composable import checkpoint

    return checkpoint(module, **options)


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


def dcp_storage_info_class() -> type:
    """The class a DCP ``.metadata`` file pickles for each stored item's file position (``_StorageInfo``)."""
    from torch.distributed.checkpoint import filesystem

    return filesystem._StorageInfo


def layout_lookup() -> Callable[[str], Any]:
    """The function torch pickles ``torch.layout`` values with (``torch.serialization._get_layout``)."""
    return torch.serialization._get_layout


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


def thread_frame(thread: threading.Thread) -> FrameType | None:
    """The innermost Python frame ``thread`` runs now (``None`` if it runs none): CPython's ``sys._current_frames``,
    which its docs keep for debugging tools such as this watchdog."""
    return sys._current_frames().get(thread.ident or -1)


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


def all_to_all_in_flight(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """``all_to_all_single`` that returns at once (a functional collective's ``AsyncCollectiveTensor``): the first
    use of the result waits for it, so the caller computes while the rows travel. Differentiable; its backward is
    the reverse all-to-all, issued the same way."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_to_all_single_autograd(x.contiguous(), recv, send, group)


def collective_op_namespaces() -> dict[str, list[Any]]:
    """The namespaces of collective ops by API: ``"c10d"``, the ``torch.distributed`` API's ``torch.ops.c10d``;
    ``"functional"``, the functional collectives DTensor issues (``_c10d_functional`` and its autograd variants)."""
    load_functional_collectives()
    return {
        "c10d": [torch.ops.c10d],
        "functional": [torch.ops._c10d_functional, torch.ops._c10d_functional_autograd],
    }


def in_autograd_backward() -> bool:
    """Whether the autograd engine is executing a backward pass on this thread (``_current_graph_task_id``)."""
    return torch._C._current_graph_task_id() != -1


def is_higher_order_operator(func: Any) -> bool:
    """Whether a dispatched ``func`` is a higher-order operator (``torch._ops.HigherOrderOperator``)."""
    return isinstance(func, torch._ops.HigherOrderOperator)


def op_overload_packet(func: Any) -> Any:
    """The op family (``OpOverloadPacket``) a dispatched op overload belongs to (``OpOverload._overloadpacket``)."""
    return func._overloadpacket


def op_schema_arguments(func: Any) -> Sequence[Any]:
    """The declared arguments of a dispatched op (``OpOverload._schema.arguments``): ``name``,
    ``has_default_value()``, ``default_value``."""
    return func._schema.arguments


# ---------------------------------------------------------------------------------------------------- dry run
def fake_tensor_mode_class() -> type:
    """``FakeTensorMode``: tensors with shapes, dtypes and devices but no data (``torch._subclasses``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


def is_fake_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` (or, for a DTensor, its local tensor) is a fake tensor: it has no values to read."""
    from torch._subclasses.fake_tensor import FakeTensor, is_fake

    if isinstance(tensor, FakeTensor):
        return True
    if type(tensor) in (torch.Tensor, torch.nn.Parameter) or not isinstance(tensor, torch.Tensor):
        return False  # a plain tensor (the common case, answered without is_fake's walk)
    return is_fake(tensor)


def fake_tensor_of(mode: Any, tensor: Any) -> bool:
    """Whether ``tensor`` is a plain fake tensor of ``mode`` (no subclass, no constant, strided, no symbolic sizes):
    one whose view :func:`fake_view` makes."""
    from torch._subclasses.fake_tensor import FakeTensor

    return (
        type(tensor) is FakeTensor
        and tensor.fake_mode is mode
        and tensor.constant is None
        and tensor.layout is torch.strided
        and mode.shape_env is None
    )


def fake_view(mode: Any, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """A view op (``func`` in :func:`view_ops`) of ``args[0]``, a fake tensor of ``mode`` (:func:`fake_tensor_of`):
    the op's meta kernel run on the fake tensor's storage, as ``FakeTensorMode`` runs an op it has not cached, its
    output a fake tensor on the input's device. Without the mode's cache key and cached-output rebuild, which cost
    several times the view itself."""
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    device = args[0].fake_device
    with in_kernel_invocation_manager(mode):
        out = func(*args, **kwargs)
    return FakeTensor(mode, out, device)


def view_ops() -> frozenset[Any]:
    """The ops whose output is one view of their one tensor input (new sizes, strides and offset over the input's
    storage): the reshapes, transposes, slices and ``detach`` a step runs thousands of times."""
    aten = torch.ops.aten
    return frozenset(
        (
            aten.view.default,
            aten._unsafe_view.default,
            aten._reshape_alias.default,
            aten.detach.default,
            aten.alias.default,
            aten.t.default,
            aten.transpose.int,
            aten.permute.default,
            aten.expand.default,
            aten.as_strided.default,
            aten.select.int,
            aten.slice.Tensor,
            aten.unsqueeze.default,
            aten.squeeze.dim,
            aten.squeeze.dims,
        )
    )


def truth_test_ops() -> list[Any]:
    """``aten._is_any_true`` and ``aten._is_all_true``: one boolean for a whole tensor (anomaly detection's NaN test
    of every gradient, ``torch._check``)."""
    return [torch.ops.aten._is_any_true.default, torch.ops.aten._is_all_true.default]


def wrap_stage_shape_inference(stage: Any, context: Callable[[str], AbstractContextManager[Any]]) -> None:
    """Run a pipelining ``PipelineStage``'s shape inference (``_prepare_forward_infra``/``_prepare_backward_infra``,
    on the first step of a schedule) inside ``context(phase)``: ``"forward"`` (a backward inference follows),
    ``"forward only"`` or ``"backward"``.

    torch infers the shapes crossing stages by running each stage's module, forward and backward, once before the
    schedule's real work: the first stage on the batch, later ones on tensors made with ``torch.empty`` from the
    received metadata (whatever values the memory held)."""
    forward, backward = stage._prepare_forward_infra, stage._prepare_backward_infra

    def forward_inside(*args: Any, **kwargs: Any) -> Any:
        with context("forward" if kwargs.get("has_backward", False) else "forward only"):
            return forward(*args, **kwargs)

    def backward_inside(*args: Any, **kwargs: Any) -> Any:
        with context("backward"):
            return backward(*args, **kwargs)

    stage._prepare_forward_infra, stage._prepare_backward_infra = forward_inside, backward_inside


def real_tensors_temporarily() -> Any:
    """A context in which the active fake tensor mode steps aside (new tensors are real)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def item_op() -> Any:
    """``aten._local_scalar_dense``: what ``Tensor.item()`` (and ``bool()``, ``tolist()``) dispatch to."""
    return torch.ops.aten._local_scalar_dense.default


def metadata_ops() -> frozenset[Any]:
    """Ops that read a tensor's metadata (``prim.device``, ``aten.size``, ``aten.stride``, ``aten.storage_offset``):
    they make no tensor and send nothing. The autograd engine and DTensor ask a fake tensor's device through the
    dispatcher thousands of times per step, so dispatch modes that only watch tensors and collectives pass these
    straight on."""
    return frozenset(
        (
            torch.ops.prim.device.default,
            torch.ops.aten.size.default,
            torch.ops.aten.stride.default,
            torch.ops.aten.storage_offset.default,
        )
    )


def lift_ops() -> tuple[Any, ...]:
    """The ops ``torch.tensor(data)`` ends with (``aten.lift_fresh``, ``aten.lift_fresh_copy``): where a fake tensor
    mode turns a tensor made from Python data into a fake one."""
    return torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default


def dtensor_shape_propagation() -> tuple[type, str]:
    """Where DTensor computes an op's output metadata on fake tensors of the global shape (``ShardingPropagator.
    _propagate_tensor_meta_non_cached``): those tensors are no memory of the rank."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    return ShardingPropagator, "_propagate_tensor_meta_non_cached"


def register_fake_backend() -> None:
    """Register torch's ``fake`` process-group backend (every collective returns at once; an all-gather copies the
    rank's input into every slot). torch registers it when ``torch.testing._internal.distributed.fake_pg`` is
    imported."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401


# ---------------------------------------------------------------------------------------------------- attention kernels
def sdpa_builtin_home() -> ModuleType:
    """The C module whose ``scaled_dot_product_attention`` builtin ``F.scaled_dot_product_attention`` is."""
    return torch._C._nn


def aten_attention_op(name: str) -> Any:
    """A fused attention kernel or its backward, e.g. ``"_scaled_dot_product_flash_attention_for_cpu"``."""
    return getattr(torch.ops.aten, name).default


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One matmul per group of rows: rows ``offs[g-1]:offs[g]`` of ``input`` times ``weight[g]`` (``(G, K, N)``).

    ``torch.nn.functional.grouped_mm`` where torch has it (2.10+), else ``torch._grouped_mm``.
    """
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(input, weight, offs=offs)


def wrap_policy_classes(policy: Any) -> set[type] | None:
    """The module classes of an FSDP1 ``ModuleWrapPolicy`` (``None`` for another policy)."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return set(policy._module_classes) if isinstance(policy, ModuleWrapPolicy) else None
