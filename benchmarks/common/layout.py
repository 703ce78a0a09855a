"""The processes of one launch: how many, and how they split over (simulated) nodes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """Processes of one run: ``world_size = num_nodes × ranks_per_node``. Several nodes are simulated on one host
    (torchrun-style environment), so strategies and the comm counter see a multi-node topology."""

    world_size: int
    num_nodes: int = 1

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.num_nodes

    def to_dict(self) -> dict[str, int]:
        return {"world_size": self.world_size, "num_nodes": self.num_nodes, "ranks_per_node": self.ranks_per_node}
