"""The log lines saying what :func:`~lightning_dist.parallel.parallelize.parallelize` did, the same for every
strategy: activation checkpointing, compilation, then FSDP2's units, where they are sharded, ``reshard_after_forward``
and the precision, then what the strategy adds (ZeRO++'s collectives, context-parallel attention...). Pure PyTorch."""

from __future__ import annotations

from collections.abc import Iterable

from lightning_dist.parallel.mesh import ParallelDims
from lightning_dist.parallel.parallelize import ParallelizeConfig, ParallelizeRecord


def describe(
    config: ParallelizeConfig,
    record: ParallelizeRecord,
    dims: ParallelDims,
    *,
    root: str,
    precision: str,
    label: str | None = None,
    per_stage: bool = False,
    extras: Iterable[str] = (),
) -> list[str]:
    """One line per decision of ``parallelize(model, mesh, config) -> record`` on the mesh ``dims``.

    Args:
        config: What was applied.
        record: What it did.
        dims: The mesh.
        root: The class name of the (stage) root, read before ``fully_shard`` renamed it.
        precision: The precision setting.
        label: What opens the sharding line (default ``"FSDP2"``, or ``"HSDP (dp_replicate=n)"``).
        per_stage: The record is one pipeline stage's; every stage did the same with its own blocks.
        extras: Lines of the strategy's own (its collectives, its attention...), logged after these.
    """
    stage = " per stage" if per_stage else ""
    lines = [record.experts.describe()] if record.experts is not None else []
    if record.experts is not None and per_stage:
        lines[0] += "; per pipeline stage, over its data-parallel ranks (the layers counted are this rank's stage's)"
    if record.checkpointed:
        lines.append(f"activation checkpointing on {record.checkpointed}{stage}")
    if record.compiled:
        lines.append(record.compiled)
    if config.fsdp is not None and record.units is not None:
        if label is None:
            label = f"HSDP (dp_replicate={dims.dp_replicate})" if dims.dp_replicate > 1 else "FSDP2"
        where = f"dp_shard={dims.dp_shard}" + (f" × cp={dims.cp}" if dims.cp > 1 else "")
        where += f" × dp_replicate={dims.dp_replicate}" if dims.dp_replicate > 1 else ""
        where += " (gradients averaged over cp)" if dims.cp > 1 else ""
        if record.experts is not None and record.experts.sharded_over > 1:
            where += f" (experts: split over ep, units of their own over ep_fsdp={record.experts.sharded_over})"
        elif record.experts is not None:
            where += " (experts left out: split over ep)"
        lines.append(
            f"{label} sharded {record.units}"
            + (f" + {', '.join(name for name, _ in config.extra_units)}" if config.extra_units else "")
            + (f" + shared {', '.join(record.shared)} as units of their own" if record.shared else "")
            + (f" + [{', '.join(record.outside)}] as one unit" if record.outside else "")
            + f" + root {root} over {where}{stage}, reshard_after_forward={config.fsdp.reshard_after_forward},"
            f" precision={precision}" + (", cpu_offload" if config.fsdp.cpu_offload else "")
        )
    elif config.fsdp is None:
        lines.append(f"nothing sharded (no data-parallel ranks), precision={precision}")
    lines.extend(extras)
    return lines
