"""A litgpt checkpoint folder from a checkpoint: ``lit_model.pth`` (the ``GPT``'s state dict under its own names)
and ``model_config.yaml`` (litgpt's ``save_config``), which ``GPT(Config.from_file(...))`` loads strictly. A LoRA
``GPT`` (``litgpt.lora``) is merged by litgpt's own ``merge_lora_weights`` and written as the plain ``GPT`` it wraps,
as litgpt's ``merge_lora`` script writes it.

litgpt's format is one ``torch.save`` file, so the whole state dict is in memory while it is written."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from lightning_dist.checkpoint.export.names import find_prefix, map_names
from lightning_dist.checkpoint.export.report import ExportReport
from lightning_dist.checkpoint.export.source import TensorSource

WEIGHTS_FILE = "lit_model.pth"
CONFIG_FILE = "model_config.yaml"


def plan_litgpt(source: TensorSource, record: dict[str, Any], report: ExportReport) -> tuple[Any, dict[str, str]]:
    """litgpt's ``Config`` (its LoRA one for a LoRA ``GPT``) and ``{name in the model: name in the checkpoint}``."""
    try:
        from litgpt import lora
        from litgpt.config import Config
        from litgpt.model import GPT
    except ImportError as err:
        raise ImportError("--format litgpt needs the `litgpt` package: pip install litgpt") from err
    is_lora = record.get("module") == "litgpt.lora"
    config = (lora.Config if is_lora else Config)(**record["config"])
    with torch.device("meta"):
        model = (lora.GPT if is_lora else GPT)(config)
    model_specs = {name: tensor.shape for name, tensor in model.state_dict().items()}
    prefix = record.get("prefix")
    if prefix is None:
        prefix = find_prefix(source.specs, model_specs)
    report.prefix = prefix
    return config, map_names(source.specs, model_specs, prefix)


def write_litgpt(
    folder: Path, source: TensorSource, config: Any, names: dict[str, str], report: ExportReport,
    dtype: torch.dtype | None = None,
) -> list[str]:  # fmt: skip
    from litgpt import lora
    from litgpt.config import Config
    from litgpt.utils import save_config

    values = source.read(list(names.values()))
    state = {out: values[name] for out, name in names.items()}
    report.held(sum(t.nbytes for t in values.values()))
    del values
    if isinstance(config, lora.Config):
        state, config = _merged_lora(state, config), Config(**{f.name: getattr(config, f.name) for f in fields(Config)})
    if dtype is not None:
        state = {name: value.to(dtype) if value.is_floating_point() else value for name, value in state.items()}
    report.tensors, report.total_bytes = len(state), sum(t.nbytes for t in state.values())
    torch.save(state, folder / WEIGHTS_FILE)
    save_config(config, folder)
    return [WEIGHTS_FILE, CONFIG_FILE]


def _merged_lora(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The plain ``GPT``'s state of a LoRA ``GPT``'s, merged by litgpt (``merge_lora_weights``) as its
    ``merge_lora`` script merges: the adapters folded in, their tensors dropped, ``linear.`` left out of the names."""
    from litgpt import lora

    with torch.device("meta"):
        model = lora.GPT(config)
    model.load_state_dict(state, strict=True, assign=True)
    lora.merge_lora_weights(model)
    return {k.replace("linear.", ""): v for k, v in model.state_dict().items() if not lora.lora_filter(k, v)}
