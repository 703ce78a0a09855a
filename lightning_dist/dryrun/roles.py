"""Which ranks a dry run runs: one of every role in the mesh.

Ranks that differ only in their data-parallel coordinate do the same work; what changes a rank's work is its
pipeline stage and where it sits on the axes that split the model: tp and cp (its slices, its sequence shard), and
ep (its experts). For each stage the dry run takes the rank that is first on every other axis and, for each of tp,
cp and ep larger than 1, the rank that is last on that axis and first on the others (each pair shares the group of
that axis, and the agreement check compares them on it). Data-parallel ranks are covered by the first ones: the
first rank's data-parallel groups are recorded with the rest, and ``--ranks`` adds any other.
"""

from __future__ import annotations

from collections.abc import Iterable

from lightning_dist.parallel.mesh import MESH_AXES, ParallelDims

#: The axes along which ranks hold different parts of the model or the sequence (ep is handled apart).
MODEL_SPLITTING_AXES = ("cp", "tp")


def coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """``rank``'s index on each mesh axis (the mesh is row-major over ``pp, dp_replicate, dp_shard, cp, tp``)."""
    sizes = dims.as_dict()
    coords: dict[str, int] = {}
    for axis in reversed(MESH_AXES):
        coords[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return {axis: coords[axis] for axis in MESH_AXES}


def rank_at(dims: ParallelDims, coords: dict[str, int]) -> int:
    sizes = dims.as_dict()
    rank = 0
    for axis in MESH_AXES:
        rank = rank * sizes[axis] + coords.get(axis, 0)
    return rank


def role_name(dims: ParallelDims, rank: int) -> str:
    """``pp1·dp_shard15·tp0``: the rank's coordinates on the axes larger than 1 (``ep`` appended when on)."""
    coords = coordinates(dims, rank)
    parts = [f"{axis}{coords[axis]}" for axis, size in dims.as_dict().items() if size > 1]
    if dims.ep > 1:
        parts.append(f"ep{(coords['dp_shard'] * dims.cp + coords['cp']) % dims.ep}")
    return "·".join(parts) or "rank0"


def choose_ranks(dims: ParallelDims, named: Iterable[int] = ()) -> dict[int, str]:
    """Rank → role for the ranks a dry run covers by default, plus ``named`` ones, in rank order."""
    sizes = dims.as_dict()
    chosen: set[int] = set()
    for stage in range(dims.pp):
        base = {"pp": stage}
        chosen.add(rank_at(dims, base))
        for axis in MODEL_SPLITTING_AXES:
            if sizes[axis] > 1:
                chosen.add(rank_at(dims, {**base, axis: sizes[axis] - 1}))
        if dims.ep > 1:  # the last rank of the ep group: the inner ep ranks of dp_shard × cp
            last = dims.ep - 1
            chosen.add(rank_at(dims, {**base, "dp_shard": last // dims.cp, "cp": last % dims.cp}))
    for rank in named:
        if not 0 <= rank < dims.world_size:
            raise ValueError(f"--ranks {rank}: not a rank of a world of {dims.world_size} (0 … {dims.world_size - 1}).")
        coords = coordinates(dims, rank)  # and the other stages of its pipeline, which it exchanges shapes with
        chosen.update(rank_at(dims, {**coords, "pp": stage}) for stage in range(dims.pp))
    return {rank: role_name(dims, rank) for rank in sorted(chosen)}


def chains(dims: ParallelDims, ranks: list[int]) -> list[list[int]]:
    """``ranks`` grouped by pipeline: the ranks that differ only in their stage, in stage order."""
    by_chain: dict[tuple[int, ...], list[int]] = {}
    for rank in sorted(ranks, key=lambda r: coordinates(dims, r)["pp"]):
        coords = coordinates(dims, rank)
        by_chain.setdefault(tuple(v for axis, v in coords.items() if axis != "pp"), []).append(rank)
    return list(by_chain.values())
