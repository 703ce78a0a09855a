"""Exports of any of our checkpoints (a single file or a sharded folder, from any strategy and mesh) in the formats
serving and evaluation tools read: a Hugging Face model folder (``hf``) or a litgpt checkpoint folder (``litgpt``).
Pure PyTorch, one process, no GPU: see docs/export.md."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_dist.checkpoint.export.folder import write_export_folder
from lightning_dist.checkpoint.export.hf import plan_hf, write_hf
from lightning_dist.checkpoint.export.litgpt import plan_litgpt, write_litgpt
from lightning_dist.checkpoint.export.model_configs import find_config
from lightning_dist.checkpoint.export.report import ExportReport
from lightning_dist.checkpoint.export.shards import parse_size
from lightning_dist.checkpoint.export.source import CheckpointTensors
from lightning_dist.checkpoint.export_target import check_export_target

#: The formats of :func:`export_checkpoint`.
FORMATS = ("hf", "litgpt")


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    format: str = "hf",
    max_shard_size: int | str = "5GB",
    prefix: str | None = None,
    config: str | os.PathLike | None = None,
    weights_only: bool = True,
) -> ExportReport:
    """Write the model of ``checkpoint`` as a folder at ``out`` in ``format``.

    ``max_shard_size``: bytes, or a string such as ``"500MB"`` (``hf`` only); ``prefix``: the LightningModule
    attribute path of the model (``"model."``; found from the names when not given); ``config``: the model's config
    file or its folder, for a checkpoint that holds none; ``weights_only=False`` trusts the checkpoint's files with
    full unpickling. ``out`` must be free or an earlier export; nothing is written before the checks pass."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
    max_bytes = parse_size(max_shard_size)
    check_export_target(out, checkpoint, command="export")  # before the (long) read
    source = CheckpointTensors(checkpoint, weights_only)
    record = find_config(source.provenance, format, prefix, config)
    if prefix is not None:
        record = {**record, "prefix": prefix}
    report = ExportReport(out=Path(out), format=format)
    if format == "hf":
        hf_config, model, names = plan_hf(source, record, report)

        def write(folder: Path) -> list[str]:
            return write_hf(folder, source, hf_config, model, names, max_bytes, report)
    else:
        lit_config, names = plan_litgpt(source, record, report)

        def write(folder: Path) -> list[str]:
            return write_litgpt(folder, source, lit_config, names, report)

    def write_and_record(folder: Path) -> list[str]:
        report.files = write(folder)
        return report.files

    write_export_folder(out, checkpoint, format, write_and_record)
    return report


__all__ = ["FORMATS", "ExportReport", "export_checkpoint"]
