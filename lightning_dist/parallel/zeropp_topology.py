"""Where ZeRO++'s hierarchical partition (hpZ) and two-hop gradient reduce-scatter (qgZ) meet the node layout.

Pure Python: the checks and the resolved hpZ size, before any process group exists.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_dist.parallel.mesh import MeshConfigError

HPZ_OFFLOAD = (
    "hpZ keeps a secondary partition of the gathered weights on the accelerator between forward and backward, which"
    " CPU offloading cannot hold. Set hpz_partition_size=None to offload, or drop cpu_offload."
)


def resolve_hpz(
    requested: int | str | None,
    group: int,
    per_node: int,
    quantized_gradients: bool,
    cpu_offload: bool,
    warn: Callable[[str], None],
) -> int | None:
    """The hpZ partition size for a sharding group of ``group`` ranks on nodes of ``per_node`` ranks (``None``: off).

    ``requested`` is ``"auto"`` (ranks per node), an int, or ``None``. Raises :class:`MeshConfigError` for sizes that
    cannot work; ``warn`` receives what is allowed but saves nothing (one node, one rank per node).
    """
    if group % per_node:
        raise MeshConfigError(
            f"ranks_per_node={per_node} does not divide the {group} ranks ZeRO++ shards over; declare a"
            " ranks_per_node that does (whole nodes)."
        )
    auto = requested == "auto"
    hpz = per_node if auto else requested
    if auto and hpz < 2 and group > 1:  # type: ignore[operator]
        warn(
            "zeropp: one rank per node, so hpZ has no intra-node partition to keep; backward re-gathers over the"
            " whole group as in ZeRO-3 (hpZ is off)."
        )
        hpz = None
    if hpz is not None and (hpz >= group or group % hpz):  # type: ignore[operator]
        if not auto:
            raise MeshConfigError(
                f"hpz_partition_size={hpz} must divide the sharding group size {group} and be smaller than it."
            )
        warn(
            f"zeropp: all {group} ranks are on one node, so hpZ has nothing to keep off the network;"
            " backward re-gathers over the whole group as in ZeRO-3 (hpZ is a no-op here)."
        )
        hpz = None
    if hpz is not None and per_node % hpz:  # type: ignore[operator]
        warn(
            f"zeropp: hpz_partition_size={hpz} does not divide ranks_per_node={per_node}: secondary partitions span"
            " node boundaries, so backward all-gathers cross nodes. Use a divisor of ranks_per_node (or 'auto')."
        )
    if quantized_gradients and group == per_node and group > 1:
        warn(
            f"zeropp: all {group} ranks are on one node: qgZ's cross-node hop is a no-op (the reduce-scatter is"
            " still quantized inside the node). Declare ranks_per_node to simulate several nodes."
        )
    if hpz is not None and cpu_offload:
        raise MeshConfigError(HPZ_OFFLOAD)
    return hpz  # type: ignore[return-value]
