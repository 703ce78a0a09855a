"""Exports of any of our checkpoints (a single file or a sharded folder, from any strategy and mesh) in the formats
serving and evaluation tools read: a Hugging Face model folder (``hf``, LoRA adapters merged), a PEFT adapter folder
(``peft``) or a litgpt checkpoint folder (``litgpt``). Pure PyTorch, one process, no GPU: see docs/export.md."""

from __future__ import annotations

import os
from pathlib import Path

from lightning_dist.checkpoint.export.dtype import CastTensors, export_dtype
from lightning_dist.checkpoint.export.folder import finish_interrupted_export, write_export_folder
from lightning_dist.checkpoint.export.hf import plan_hf, write_hf
from lightning_dist.checkpoint.export.litgpt import plan_litgpt, write_litgpt
from lightning_dist.checkpoint.export.lora import MergedLora, lora_record
from lightning_dist.checkpoint.export.model_configs import WEIGHTS_ORIGIN_KEY, find_config
from lightning_dist.checkpoint.export.peft import base_model_name, plan_peft, write_peft
from lightning_dist.checkpoint.export.report import ExportReport
from lightning_dist.checkpoint.export.shards import parse_size
from lightning_dist.checkpoint.export.source import CheckpointTensors, TensorSource
from lightning_dist.checkpoint.export.tokenizer import copy_tokenizer_files, tokenizer_source
from lightning_dist.checkpoint.export_target import check_export_target
from lightning_dist.progress import Progress

#: The formats of :func:`export_checkpoint`.
FORMATS = ("hf", "peft", "litgpt")


def export_checkpoint(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    format: str = "hf",
    max_shard_size: int | str = "5GB",
    prefix: str | None = None,
    config: str | os.PathLike | None = None,
    weights_only: bool = True,
    dtype: str | None = None,
    tokenizer: str | os.PathLike | None = None,
    base_model: str | None = None,
    stacked_experts: bool = False,
    progress: bool = False,
) -> ExportReport:
    """Write the model of ``checkpoint`` as a folder at ``out`` in ``format``: ``hf`` (a Hugging Face model folder, a
    LoRA model's adapters merged), ``peft`` (a LoRA model's adapter folder) or ``litgpt``.

    ``max_shard_size``: bytes, or a string such as ``"500MB"`` (``hf`` only); ``prefix``: the LightningModule
    attribute path of the model (``"model."``; found from the names when not given); ``config``: the model's config
    file or its folder, for a checkpoint that holds none; ``weights_only=False`` trusts the checkpoint's files with
    full unpickling; ``dtype``: ``"bfloat16"``, ``"float16"`` or ``"float32"`` for every floating-point tensor (default:
    as trained); ``tokenizer``: the folder to copy the tokenizer files from (default: the ``initial_weights`` folder
    the checkpoint records; ``hf`` and ``peft``); ``base_model``: the base model ``adapter_config.json`` names
    (``peft``; default: that folder); ``stacked_experts``: keep a mixture-of-experts model's experts stacked as
    transformers 5 holds them, not per expert as published checkpoints do (``hf``); ``progress``: show the bytes
    written on stderr (:mod:`lightning_dist.progress`). ``out`` must be free or an earlier export of the same format;
    nothing is written before the checks pass."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, not {format!r}")
    max_bytes, cast = parse_size(max_shard_size), export_dtype(dtype)
    check_export_target(out, checkpoint, command="export", fmt=format)  # before the (long) read
    if tokenizer is not None and format != "litgpt":
        tokenizer_source(None, tokenizer)  # a folder that is not there fails before the read too
    tidied = finish_interrupted_export(Path(out))
    source: TensorSource = CheckpointTensors(checkpoint, weights_only)
    origin = source.provenance.get(WEIGHTS_ORIGIN_KEY)
    origin = origin if isinstance(origin, str) else None
    report = ExportReport(out=Path(out), format=format, tidied=tidied)
    if format == "peft":
        lora = lora_record(source.provenance)
        peft_config, adapter_names = plan_peft(source, lora, base_model_name(lora, origin, base_model))
        source = CastTensors(source, cast) if cast is not None else source
        report.prefix = (lora or {}).get("prefix", "")

        def write(folder: Path) -> list[str]:
            return write_peft(folder, source, peft_config, adapter_names, report)
    elif format == "hf":
        record = find_config(source.provenance, format, prefix, config)
        if prefix is not None:
            record = {**record, "prefix": prefix}
        lora = lora_record(source.provenance, record.get("prefix"))
        if lora is not None:  # the adapters merged into their base weights, under the base model's names
            source = MergedLora(source, lora)
            report.merged = len(lora["layers"])
        source = CastTensors(source, cast) if cast is not None else source
        hf_config, model, names = plan_hf(source, record, report)

        def write(folder: Path) -> list[str]:
            return write_hf(folder, source, hf_config, model, names, max_bytes, report, not stacked_experts, progress)
    else:
        record = find_config(source.provenance, format, prefix, config)
        if prefix is not None:
            record = {**record, "prefix": prefix}
        lit_config, names = plan_litgpt(source, record, report)

        def write(folder: Path) -> list[str]:
            return write_litgpt(folder, source, lit_config, names, report, cast)

    tokens_from, report.tokenizer = tokenizer_source(origin, tokenizer) if format != "litgpt" else (None, "")

    def write_and_record(folder: Path) -> list[str]:
        if format == "hf":
            files = write(folder)
        else:  # one weights file: done when it is written
            with Progress(1, "export", unit="files", quiet=not progress) as shown:
                files = write(folder)
                shown.update(1)
        copied = copy_tokenizer_files(tokens_from, folder)
        report.files = sorted(set(files) | set(copied))
        return report.files

    write_export_folder(out, checkpoint, format, write_and_record)
    return report


__all__ = ["FORMATS", "ExportReport", "export_checkpoint"]
