"""The ``reshard_after_forward`` option every strategy takes: checked when the strategy is built, resolved against
the mesh.

Its default (``None``) is on, except under a pipeline (``pp > 1``), as torchtitan's: a schedule runs the forward of
every micro-batch before (or between) the backwards, so with resharding each micro-batch's forward all-gathers
every unit's parameters again and so does its backward; kept gathered, a stage gathers once per step. The cost is
the unsharded parameters of the stage's units held from the first forward to the last backward.
"""

from __future__ import annotations

from typing import Any

from lightning_dist.parallel.mesh import MeshConfigError, ParallelDims
from lightning_dist.parallel.validation import is_int


def check_reshard_after_forward(value: Any) -> bool | int | None:
    """``value`` if it is ``None``, a bool or an int of at least 2; a ``TypeError``/``ValueError`` naming the option
    otherwise."""
    if value is None or isinstance(value, bool):
        return value
    if not is_int(value):
        raise TypeError(
            f"reshard_after_forward={value!r} must be True, False, None (the default) or an int group size, not a"
            f" {type(value).__name__}."
        )
    if value < 2:
        raise ValueError(f"reshard_after_forward={value}: an int must be a group size of at least 2.")
    return value


def resolve_reshard_after_forward(value: bool | int | None, dims: ParallelDims, default: bool = True) -> bool | int:
    """What FSDP2 applies: ``value`` when given; else ``default`` (what the strategy's other options imply), except
    ``False`` when ``dims.pp > 1``."""
    if value is not None:
        return value
    return default and dims.pp == 1


def check_reshard_after_forward_mesh(value: bool | int | None, dims: ParallelDims) -> None:
    """Refuse an int group size that does not divide the sharding group (``dp_shard × cp``) or is not smaller."""
    if is_int(value) and (dims.fsdp % value or value >= dims.fsdp):  # type: ignore[operator]
        raise MeshConfigError(
            f"reshard_after_forward={value} must be a divisor of the sharding group size {dims.fsdp} smaller than"
            " it (the size of the groups backward all-gathers stay in)."
        )
