"""Pure-PyTorch parallelism building blocks (no Lightning import): usable in any training loop."""

from lightning_dist.parallel.mesh import DERIVED_GROUPS, MESH_AXES, MeshConfigError, ParallelDims

__all__ = ["DERIVED_GROUPS", "MESH_AXES", "MeshConfigError", "ParallelDims"]
