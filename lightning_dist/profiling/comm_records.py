"""What :class:`~lightning_dist.profiling.CommCounter` records: one :class:`CommRecord` per collective (or per tensor
of a coalesced one), the node layout that decides which bytes cross nodes, and the sums over records.

The byte fields are defined in :mod:`lightning_dist.profiling.comm_traffic`.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

UNLABELED = "unlabeled"
BYTE_FIELDS = ("tensor_bytes", "sent_bytes", "cross_node_bytes")

# Other spellings of the same collective, so that queries accept the name the caller knows.
_OP_ALIASES = {
    "all_gather_single": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "isend": "send",
    "irecv": "recv",
}


def canonical_op_name(op: str) -> str:
    """Map an alias of a collective to the name used in :class:`CommRecord` (``all_gather_single`` ->
    ``all_gather_into_tensor``, ``reduce_scatter_single`` -> ``reduce_scatter_tensor``, ``isend`` -> ``send``, ...).

    Args:
        op: A collective's name as spelled by ``torch.distributed`` or the functional collectives.

    Returns:
        The canonical name (unknown names are returned unchanged).
    """
    return _OP_ALIASES.get(op, op)


@dataclass(frozen=True)
class NodeTopology:
    """Which global ranks share a node: rank ``r`` is on node ``r // ranks_per_node``.

    Args:
        ranks_per_node: Ranks per node; ``None`` puts every rank on one node (no cross-node traffic).
    """

    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1 or None, got {self.ranks_per_node}")

    @classmethod
    def from_env(cls, var: str = "LOCAL_WORLD_SIZE") -> NodeTopology:
        """Build the topology from an environment variable (``LOCAL_WORLD_SIZE``, set by ``torchrun``).

        Args:
            var: Name of the variable holding the number of ranks per node.

        Returns:
            ``NodeTopology(int(os.environ[var]))``, or the single-node topology when the variable is unset.
        """
        value = os.environ.get(var)
        return cls(int(value)) if value else cls()

    def node_of(self, rank: int) -> int:
        """Return the node index of global rank ``rank``."""
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def same_node(self, rank_a: int, rank_b: int) -> bool:
        """Return whether two global ranks are on the same node."""
        return self.node_of(rank_a) == self.node_of(rank_b)


@dataclass(frozen=True)
class CommRecord:
    """One collective (or one tensor of a coalesced collective) as seen by this rank.

    Attributes:
        op: Canonical op name (see :func:`canonical_op_name`), e.g. ``"all_gather_into_tensor"``, ``"send"``.
        api: ``"c10d"`` (``torch.distributed`` API, ``torch.ops.c10d``) or ``"functional"`` (functional collectives).
        group_size: Number of ranks in the process group.
        group_ranks: Global ranks of the group ordered by group rank (empty if the group is not registered with
            ``torch.distributed``).
        rank: This rank's global rank (``-1`` if unknown).
        dtype: Element type of the payload.
        tensor_bytes: Logical payload, see the module docstring.
        sent_bytes: Bytes this rank sends, see the module docstring.
        cross_node_bytes: Part of ``sent_bytes`` destined to ranks on other nodes.
        phase: Phase label active when the op was issued.
        async_op: ``async_op`` flag of the call (``None`` when not observable, as for point-to-point ops).
        peer: Global rank of the peer (point-to-point) or of the root (rooted collectives), else ``None``.
        spans_nodes: Whether the op's participants include a rank on another node (for point-to-point ops: whether
            the peer is on another node; ``False`` for a receive from any source).
    """

    op: str
    api: str
    group_size: int
    group_ranks: tuple[int, ...]
    rank: int
    dtype: torch.dtype
    tensor_bytes: int
    sent_bytes: int
    cross_node_bytes: int
    phase: str
    async_op: bool | None
    peer: int | None = None
    spans_nodes: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (the dtype as a string such as ``"bfloat16"``)."""
        out = dataclasses.asdict(self)
        out["dtype"] = dtype_name(self.dtype)
        out["group_ranks"] = list(self.group_ranks)
        return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def empty_stats() -> dict[str, int]:
    return {"count": 0, **{f: 0 for f in BYTE_FIELDS}}


def aggregate(records: Iterable[CommRecord], key: Callable[[CommRecord], str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(empty_stats)
    for r in records:
        stats = out[key(r)]
        stats["count"] += 1
        for f in BYTE_FIELDS:
            stats[f] += getattr(r, f)
    return dict(out)
