"""One named N-D device mesh for every strategy.

Axis names, outer to inner: ``pp, dp_replicate, dp_shard, cp, tp``. Every strategy is this mesh with some axes of
size 1. Three derived groups are named once here and used everywhere:

- ``batch`` = dp_replicate × dp_shard: ranks that see different data (the sampler's replicas).
- ``fsdp``  = dp_shard × cp: parameters are sharded and gradients reduced over it.
- ``loss``  = dp_replicate × dp_shard × cp: logged scalars are averaged over it.

Expert parallelism (``ep``) is not a sixth axis: as in torchtitan it borrows ranks from ``fsdp`` (ep divides
dp_shard × cp). ``mesh["ep"]`` is the inner ``ep`` ranks of each fsdp group (they exchange tokens and each holds
``E/ep`` experts); ``mesh["ep_replicas"]`` is the rest of the loss group (dp_replicate × dp_shard·cp/ep), the ranks
that hold the same experts. Of those, ``mesh["ep_fsdp"]`` (dp_shard·cp/ep) shard the experts' weights between them
as FSDP shards the dense ones, and ``mesh.experts_data_parallel`` is the experts' FSDP mesh (2-D with dp_replicate
for HSDP), cut from the same split of the loss group as ``mesh["ep"]`` so FSDP2 can join the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from lightning_dist.compat import flatten_mesh, unflatten_mesh
from lightning_dist.parallel.validation import is_positive_int

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DERIVED_GROUPS: dict[str, tuple[str, ...]] = {
    "batch": ("dp_replicate", "dp_shard"),
    "fsdp": ("dp_shard", "cp"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
}


# The strategy options that set each axis, by the names the strategies use (the first one a strategy has is its).
AXIS_OPTIONS: dict[str, tuple[str, ...]] = {
    "pp": ("pipeline_parallel_size",),
    "dp_replicate": ("data_parallel_replicate_size",),
    "dp_shard": ("data_parallel_shard_size", "data_parallel_size"),
    "cp": ("context_parallel_size",),
    "tp": ("tensor_parallel_size",),
    "ep": ("expert_parallel_size",),
}


class MeshConfigError(ValueError):
    """Raised when the requested parallel sizes cannot form a mesh over the available processes."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the five mesh axes. Their product must equal the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    #: Expert parallelism: ranks borrowed from ``fsdp`` (dp_shard × cp) that split the experts; not in the product.
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not is_positive_int(value):
                raise MeshConfigError(f"Mesh axis {f.name!r} must be a positive integer, got {value!r}.")
        if self.fsdp % self.ep:
            raise MeshConfigError(
                f"expert_parallel_size={self.ep} must divide dp_shard × cp = {self.dp_shard} × {self.cp} ="
                f" {self.fsdp}: expert parallelism borrows its ranks from the data-parallel shard group. Choose an"
                f" expert_parallel_size among {[d for d in range(1, self.fsdp + 1) if self.fsdp % d == 0]}, or more"
                " data-parallel ranks."
            )

    @classmethod
    def resolve(
        cls, world_size: int, options: Mapping[str, str] | None = None, **sizes: int | str | None
    ) -> ParallelDims:
        """Build dims for ``world_size`` where at most one axis may be ``"auto"`` (it takes what is left).

        Axes not given are 1. ``options`` names the option that set each axis (``{"tp": "tensor_parallel_size"}``),
        for the messages. Raises :class:`MeshConfigError` naming the sizes when they do not fit.
        """
        ep = sizes.pop("ep", 1)
        if ep != "auto" and not is_positive_int(ep):
            raise MeshConfigError(
                f"expert_parallel_size={ep!r} is not a valid size. Pass a positive int, or 'auto' for all of"
                " dp_shard × cp."
            )
        unknown = set(sizes) - set(MESH_AXES)
        if unknown:
            raise MeshConfigError(f"Unknown mesh axes {sorted(unknown)}; the axes are {list(MESH_AXES)}.")
        labels = {axis: (options or {}).get(axis, f"mesh axis {axis}") for axis in sizes}
        auto = [name for name, size in sizes.items() if size in ("auto", None, -1)]
        if len(auto) > 1:
            raise MeshConfigError(
                f"Only one size can be 'auto', got {_describe({labels[a]: 'auto' for a in auto})}. Give all but one"
                " of them a number."
            )
        fixed = {name: size for name, size in sizes.items() if name not in auto}
        for name, size in fixed.items():
            if not is_positive_int(size):
                hint = f" (a {type(size).__name__}: write {size.strip()}, not {size!r})" if _is_digits(size) else ""
                raise MeshConfigError(
                    f"{labels[name]}={size!r} is not a valid size{hint}. Pass a positive int, or 'auto' to give this"
                    " axis the processes the other sizes leave."
                )
        product = 1
        for size in fixed.values():
            product *= size  # type: ignore[operator]
        named = {labels[axis]: size for axis, size in fixed.items()}
        if auto:
            if world_size % product != 0:
                raise MeshConfigError(
                    f"Cannot fit {_describe(named)} into {world_size} processes: {world_size} is not divisible by"
                    f" {product}. Choose sizes whose product divides the number of processes (devices × num_nodes)."
                )
            fixed[auto[0]] = world_size // product
        elif product != world_size:
            raise MeshConfigError(
                f"{_describe(named)} make a mesh of {product} ranks, but {world_size} processes are running"
                f" (devices × num_nodes). Make the sizes multiply to {world_size}, or set one of them to 'auto'."
            )
        if ep == "auto":  # every rank of the fsdp group (dp_shard × cp)
            ep = fixed.get("dp_shard", 1) * fixed.get("cp", 1)  # type: ignore[operator]
        return cls(**fixed, ep=ep)  # type: ignore[arg-type]

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def batch(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    def batch_rank(self, global_rank: int) -> int:
        """This rank's index in the ``batch`` group (the mesh is row-major over ``pp, dp_replicate, dp_shard, cp,
        tp``, as ``init_device_mesh`` lays it out), so ranks that differ only in pp, cp or tp share it."""
        return (global_rank // (self.cp * self.tp)) % self.batch

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_AXES}

    def __str__(self) -> str:
        parts = [f"{name}={size}" for name, size in self.as_dict().items() if size > 1]
        text = " × ".join(parts) if parts else "single rank"
        return f"{text} (ep={self.ep} of dp_shard × cp)" if self.ep > 1 else text

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """Create the 5-D mesh (size-1 axes included) and the derived groups. Collective: call on every rank."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, tuple(self.as_dict().values()), mesh_dim_names=MESH_AXES)
        derived = {name: flatten_mesh(world[axes], name) for name, axes in DERIVED_GROUPS.items()}
        # FSDP's mesh: 1-D over the fsdp group, or for HSDP 2-D (replicate, shard), cut from the flattened loss group
        # rather than sliced from the root (slicing flattened dims out of the root is deprecated in torch 2.13). A 2-D
        # mesh with replicate=1 would make FSDP2 run its replica all-reduce over one-rank groups every step.
        if self.dp_replicate == 1:
            data_parallel = derived["fsdp"]
        else:
            sizes, names = (self.dp_replicate, self.fsdp), ("dp_replicate", "fsdp")
            data_parallel = unflatten_mesh(derived["loss"], 0, sizes, names)
        experts_data_parallel = None
        if self.ep > 1:
            # loss = dp_replicate × dp_shard × cp, row-major: its inner ep ranks are ep's, the rest hold the same
            # experts (dp_replicate × ep_fsdp), of which ep_fsdp shard them
            sizes = (self.dp_replicate, self.fsdp // self.ep, self.ep)
            split = unflatten_mesh(derived["loss"], 0, sizes, ("dp_replicate", "ep_fsdp", "ep"))
            derived["ep"], derived["ep_fsdp"] = split["ep"], split["ep_fsdp"]
            derived["ep_replicas"] = flatten_mesh(split["dp_replicate", "ep_fsdp"], "ep_replicas")
            experts_data_parallel = split["ep_fsdp"] if self.dp_replicate == 1 else split["dp_replicate", "ep_fsdp"]
        return ParallelMesh(self, world, derived, data_parallel, experts_data_parallel)


@dataclass(frozen=True)
class ParallelMesh:
    """The built mesh: ``mesh["tp"]`` for an axis, ``mesh["batch"]`` for a derived group (both 1-D DeviceMeshes)."""

    dims: ParallelDims
    world: DeviceMesh
    derived: dict[str, DeviceMesh]
    data_parallel: DeviceMesh
    #: The mesh FSDP shards expert weights over (``ep_fsdp``, or ``(dp_replicate, ep_fsdp)``), when ``ep > 1``.
    experts_data_parallel: DeviceMesh | None = None

    def __getitem__(self, name: str) -> DeviceMesh:
        if name in self.derived:
            return self.derived[name]
        if name in MESH_AXES:
            return self.world[name]
        raise KeyError(f"No mesh axis or group {name!r}; axes: {list(MESH_AXES)}, groups: {list(DERIVED_GROUPS)}.")


def require_split_axis(dims: ParallelDims, axis: str, option: str, what: str) -> None:
    """Raise :class:`MeshConfigError` unless mesh axis ``axis`` has at least 2 ranks: a strategy that splits
    ``what`` over it would otherwise do nothing."""
    size = getattr(dims, axis)
    if size < 2:
        raise MeshConfigError(
            f"{option}={size}: {what} needs at least 2 ranks (the mesh is {dims}). Use more devices, smaller sizes"
            " for the other axes, or the fsdp2 strategy for pure data parallelism."
        )


def _is_digits(value: object) -> bool:
    return isinstance(value, str) and value.strip().isdigit()


def _describe(sizes: dict[str, object]) -> str:
    return ", ".join(f"{name}={size}" for name, size in sizes.items()) or "(no axes)"
