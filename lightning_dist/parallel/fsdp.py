"""Applying FSDP2 (``fully_shard``) to a model: each selected block, then the root."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from lightning_dist.compat import end_fsdp_forward_before_backward, replaced_post_forward_mesh_info
from lightning_dist.parallel.validation import is_int

ShardingMode = Literal["full", "grad_op", "no_shard", "hybrid"]
SHARDING_MODES: tuple[str, ...] = ("full", "grad_op", "no_shard", "hybrid")


@dataclass
class FSDPConfig:
    """How to shard: what ``fully_shard`` receives for every unit."""

    reshard_after_forward: bool | int = True
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    cpu_offload: bool = False

    @property
    def offload_policy(self) -> OffloadPolicy:
        return CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()


@dataclass
class MeshUnit:
    """A module sharded as a unit of its own over a mesh other than the model's (expert weights over ep_fsdp), with
    FSDP2's ``shard_placement_fn`` for its parameters (``None``: dim 0)."""

    module: nn.Module
    mesh: DeviceMesh
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """All modules of ``model`` (itself included) that ``fully_shard`` was applied to."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_fully_sharded(model: nn.Module) -> bool:
    return bool(fsdp_modules(model))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    blocks: Iterable[nn.Module],
    config: FSDPConfig,
    root_mp_policy: MixedPrecisionPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    mesh_units: Iterable[MeshUnit] = (),
) -> list[nn.Module]:
    """Shard every block as its own communication group, then everything outside the blocks (embeddings, final norm,
    head) as one group kept gathered from forward to the end of backward, then the root. Returns that group.
    ``ignored_params`` stay as they are in every unit (``ModuleList`` experts split over ep); ``mesh_units`` are
    sharded first, each over its own mesh (stacked experts over ep_fsdp), so the blocks around them leave them be.

    ``mesh`` is 1-D (fully sharded) or 2-D ``(replicate, shard)`` (HSDP). The modules outside the blocks run first
    and last in forward, so backward needs them again at once. They are not left to the root: the root's "forward"
    is the whole ``training_step``, which calls the model's ``forward`` inside it, and FSDP2 fully reshards a unit
    whose forward is nested in itself, so backward would gather those parameters a second time.
    """
    blocks = list(blocks)
    # A module shared by several blocks becomes a unit of its own; fully_shard must run bottom-up (a unit nested in
    # another unit, a regex matching both, or a shared module, is sharded first) so the enclosing units skip it.
    blocks = sorted([*shared_submodules(model, blocks), *blocks], key=_height)
    with _one_post_forward_mesh_per_size():
        for unit in mesh_units:
            fully_shard(
                unit.module,
                mesh=unit.mesh,
                reshard_after_forward=_reshard_within(config.reshard_after_forward, unit.mesh),
                shard_placement_fn=unit.shard_placement_fn,
                mp_policy=config.mp_policy,
                offload_policy=config.offload_policy,
            )
        for block in blocks:
            fully_shard(
                block,
                mesh=mesh,
                reshard_after_forward=config.reshard_after_forward,
                mp_policy=config.mp_policy,
                offload_policy=config.offload_policy,
                ignored_params=ignored_params,
            )
    outside = modules_outside(model, blocks)
    if outside:
        fully_shard(
            outside,
            mesh=mesh,
            reshard_after_forward=False,
            mp_policy=config.mp_policy,
            offload_policy=config.offload_policy,
            ignored_params=ignored_params,
        )
        _ignore_view_output_warning(outside)
    fully_shard(
        model,
        mesh=mesh,
        reshard_after_forward=False,
        mp_policy=root_mp_policy or config.mp_policy,
        offload_policy=config.offload_policy,
        ignored_params=ignored_params,
    )
    return outside


def _reshard_within(reshard_after_forward: bool | int, mesh: DeviceMesh) -> bool | int:
    """An int ``reshard_after_forward`` (a smaller world to keep the parameters on) for a unit over another mesh:
    kept if it divides that mesh's shard dim, else full resharding (``True``)."""
    if is_int(reshard_after_forward) and mesh.size(mesh.ndim - 1) % reshard_after_forward:
        return True
    return reshard_after_forward


@contextmanager
def _one_post_forward_mesh_per_size() -> Iterator[None]:
    """Let every unit sharded with the same int ``reshard_after_forward`` share one post-forward mesh.

    FSDP2 (torch 2.13) builds a new DeviceMesh, i.e. new process groups, for each unit given an int
    ``reshard_after_forward`` (pytorch/pytorch#153302); on NCCL every one of them holds communicator memory, once per
    transformer block. The groups are identical, so they are created once and reused while sharding.
    """
    cache: dict[tuple[int, int], Any] = {}

    def share(original: Callable[..., Any]) -> Callable[..., Any]:
        def shared(reshard_after_forward: bool | int, mesh_info: Any) -> Any:
            if not is_int(reshard_after_forward):
                return original(reshard_after_forward, mesh_info)
            key = (id(mesh_info.mesh), reshard_after_forward)
            if key not in cache:
                cache[key] = original(reshard_after_forward, mesh_info)
            return cache[key]

        return shared

    with replaced_post_forward_mesh_info(share):  # another torch layout: nothing replaced, nothing to share
        yield


def _ignore_view_output_warning(unit: list[nn.Module]) -> None:
    """Silence FSDP2's "returned a view tensor" warning for the unit of modules outside the blocks, only.

    ``nn.Linear`` on a 3-D input returns a view, so this unit (embeddings, norms, head) triggers the warning on every
    forward, in every process (e.g. for ``nn.Transformer`` models). It warns that an in-place op on the view would
    drop the pre-backward all-gather; this unit is never resharded between forward and backward
    (``reshard_after_forward=False``), so there is nothing to re-gather. Other units keep the warning.
    """
    classes = ", ".join(type(m).__name__ for m in unit)
    warnings.filterwarnings(
        "ignore", message=re.escape(f"FSDP2-wrapped module ({classes}) returned a view tensor"), category=UserWarning
    )


def shared_submodules(model: nn.Module, units: Iterable[nn.Module]) -> list[nn.Module]:
    """Modules holding parameters that lie inside more than one of ``units`` (one ``nn.Linear`` used by two
    blocks). Each must be sharded as a unit of its own, before the units containing it.

    Raises ``ValueError`` for a single parameter registered in modules of different units (not a shared module):
    FSDP2 cannot shard one parameter in two units.
    """
    units = list(units)
    unit_ids = {id(u) for u in units}
    containing: dict[int, set[int]] = {}
    modules: dict[int, nn.Module] = {}
    owners: dict[int, dict[int, nn.Module]] = {}  # parameter -> unit -> owning module
    for index, unit in enumerate(units):
        for module in unit.modules():
            if not any(True for _ in module.parameters(recurse=False)):
                continue
            containing.setdefault(id(module), set()).add(index)
            modules[id(module)] = module
            for param in module.parameters(recurse=False):
                owners.setdefault(id(param), {})[index] = module
    shared = [modules[i] for i, where in containing.items() if len(where) > 1 and i not in unit_ids]
    shared_ids = {id(m) for m in shared}
    for by_unit in owners.values():
        owning = {id(m) for m in by_unit.values()}
        if len(owning) > 1 and not owning <= shared_ids | unit_ids:
            names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
            where = " and ".join(sorted(names.get(id(m), type(m).__name__) for m in by_unit.values()))
            raise ValueError(
                f"One parameter is registered in {where}, which belong to different FSDP units: FSDP2 cannot shard a"
                " parameter in two units. Share the whole module instead (e.g. `blocks[1].mlp.up = blocks[0].mlp.up`),"
                " or choose units (wrap_modules / wrap_regex) that contain both places."
            )
    return shared


def modules_outside(model: nn.Module, units: Iterable[nn.Module]) -> list[nn.Module]:
    """Submodules of ``model`` holding parameters of their own that lie outside every unit, except those sharing a
    parameter with a unit or with the root itself (such parameters stay with the root)."""
    units = [*units, *(m for m in model.modules() if isinstance(m, FSDPModule) and m is not model)]  # already sharded
    inside = {id(m) for unit in units for m in unit.modules()}
    taken = {id(p) for unit in units for p in unit.parameters()} | {id(p) for p in model.parameters(recurse=False)}
    return [
        module
        for module in model.modules()
        if module is not model
        and id(module) not in inside
        and any(True for _ in module.parameters(recurse=False))
        and not any(id(p) in taken for p in module.parameters(recurse=False))
    ]


def _height(module: nn.Module) -> int:
    """Levels of submodules below ``module``: a unit nested in another always has a smaller height."""
    return 1 + max((_height(child) for child in module.children()), default=0)


def end_forward_before_backward(model: nn.Module, loss: Tensor) -> None:
    """Let FSDP2 reduce every gradient of a backward that starts while ``model``'s forward is still running.

    FSDP2 finishes a forward pass when the root module's forward returns. Where the root's forward is a whole
    ``training_step`` that runs its own backwards (manual optimization), that is too late: a unit of several modules
    of which only some ran (a GAN's critic, called outside ``forward``) has then registered no hook that would
    reduce-scatter its gradients, and they stayed unreduced, invisible to the optimizer. Finishing the pass on
    ``loss`` first makes the backward reduce every unit's gradients, as after a forward that returned. No effect on a
    model without FSDP2, or on a loss that needs no gradient.
    """
    if isinstance(model, FSDPModule) and loss.requires_grad:
        end_fsdp_forward_before_backward(model, loss)


def gather_root(model: nn.Module) -> None:
    """Gather again the parameters the root FSDP module holds itself (not in a unit), as its forward's start left
    them. For a training step that goes on after a backward or an optimizer step (manual optimization): both reshard
    the root, and the step reads the root's own parameters outside any module call, where no FSDP hook gathers
    them."""
    if isinstance(model, FSDPModule):
        model.unshard()


def root_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters the root FSDP module holds itself, by name, as the optimizer holds them: call it while the
    root is sharded (after set-up)."""
    return dict(model.named_parameters(recurse=False)) if isinstance(model, FSDPModule) else {}


def toggled_while_gathered(model: nn.Module, params: dict[str, nn.Parameter]) -> list[str]:
    """The names of ``params`` (:func:`root_parameters`) whose ``requires_grad`` was changed while the root held them
    gathered (``toggle_optimizer`` inside a training step): the gathered copies the step computes with do not see it."""
    return [name for name, param in params.items() if getattr(model, name).requires_grad != param.requires_grad]


def reshard_all(model: nn.Module) -> None:
    """Return every FSDP unit to its sharded state.

    Needed before an optimizer step and after an evaluation loop when units may be left gathered (``grad_op``,
    an integer ``reshard_after_forward``, or a ``no_grad`` forward): otherwise the next forward could use the
    pre-step gathered weights.
    """
    for module in fsdp_modules(model):
        module.reshard()
