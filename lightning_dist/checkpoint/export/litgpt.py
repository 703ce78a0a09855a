"""A litgpt checkpoint folder from a checkpoint: ``lit_model.pth`` (the ``GPT``'s state dict under its own names)
and ``model_config.yaml`` (litgpt's ``save_config``), which ``GPT(Config.from_file(...))`` loads strictly.

litgpt's format is one ``torch.save`` file, so the whole state dict is in memory while it is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_dist.checkpoint.export.names import find_prefix, map_names
from lightning_dist.checkpoint.export.report import ExportReport
from lightning_dist.checkpoint.export.source import CheckpointTensors

WEIGHTS_FILE = "lit_model.pth"
CONFIG_FILE = "model_config.yaml"


def plan_litgpt(source: CheckpointTensors, record: dict[str, Any], report: ExportReport) -> tuple[Any, dict[str, str]]:
    """litgpt's ``Config`` and ``{name in lit_model.pth: name in the checkpoint}``."""
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError as err:
        raise ImportError("--format litgpt needs the `litgpt` package: pip install litgpt") from err
    config = Config(**record["config"])
    with torch.device("meta"):
        model = GPT(config)
    model_specs = {name: tensor.shape for name, tensor in model.state_dict().items()}
    prefix = record.get("prefix")
    if prefix is None:
        prefix = find_prefix(source.specs, model_specs)
    report.prefix = prefix
    return config, map_names(source.specs, model_specs, prefix)


def write_litgpt(
    folder: Path, source: CheckpointTensors, config: Any, names: dict[str, str], report: ExportReport
) -> list[str]:
    from litgpt.utils import save_config

    tensors = source.read(list(names.values()))
    report.held(sum(t.nbytes for t in tensors.values()))
    report.tensors, report.total_bytes = len(names), sum(t.nbytes for t in tensors.values())
    torch.save({out: tensors[name] for out, name in names.items()}, folder / WEIGHTS_FILE)
    del tensors
    save_config(config, folder)
    return [WEIGHTS_FILE, CONFIG_FILE]
