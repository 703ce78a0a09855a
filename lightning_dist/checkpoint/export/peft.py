"""The adapter folder of a LoRA checkpoint, as PEFT's ``save_pretrained`` writes it: ``adapter_model.safetensors``
(the adapters' tensors under PEFT's saved names: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``,
the adapter's name left out) and ``adapter_config.json`` (the adapter's config, written by PEFT, naming the base
model), which ``PeftModel.from_pretrained(base, OUT)`` loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.export.report import ExportReport
from lightning_dist.checkpoint.export.source import TensorSource
from lightning_dist.checkpoint.export_target import SAFETENSORS_MARKER

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def plan_peft(
    source: TensorSource, record: dict[str, Any] | None, base_model: str | None
) -> tuple[Any, dict[str, str]]:
    """PEFT's config object (naming ``base_model``) and ``{name in the adapter file: name in the checkpoint}``."""
    if record is None:
        raise CheckpointError(
            "--format peft writes a PEFT adapter, and the checkpoint holds no PEFT model (a module wrapped with"
            " get_peft_model, saved by lightning_dist): export its model with --format hf."
        )
    try:
        from peft import PeftConfig
    except ImportError as err:
        raise ImportError("--format peft needs the `peft` package: pip install peft") from err
    config = PeftConfig.from_peft_type(
        **{**record["config"], "base_model_name_or_path": base_model, "inference_mode": True}
    )
    adapter, prefix = record["adapter"], record["prefix"]
    names = {}
    for layer in record["layers"]:
        under = f"{record['base_prefix']}{layer}."
        for key in source.specs:
            tail = key[len(under) :]
            if key.startswith(under) and not tail.startswith("base_layer.") and f".{adapter}." in f".{tail}":
                names[key[len(prefix) :].replace(f".{adapter}.", ".")] = key
    return config, names


def write_peft(
    folder: Path, source: TensorSource, config: Any, names: dict[str, str], report: ExportReport
) -> list[str]:
    from safetensors.torch import save_file

    values = source.read(list(names.values()))
    report.held(sum(t.nbytes for t in values.values()))
    tensors = {out: values[key].contiguous() for out, key in names.items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), {"format": "pt", SAFETENSORS_MARKER: "exported"})
    config.save_pretrained(str(folder))
    report.tensors, report.total_bytes = len(tensors), sum(t.nbytes for t in tensors.values())
    return [WEIGHTS_FILE, CONFIG_FILE]


def base_model_name(record: dict[str, Any] | None, origin: str | None, given: str | None) -> str | None:
    """What ``adapter_config.json`` names as the base model: the one given, else the ``initial_weights`` folder the
    checkpoint records, else what the adapter's config already named (a ``from_pretrained`` name)."""
    if given is not None:
        return given
    if origin is not None:
        return origin
    return (record or {}).get("config", {}).get("base_model_name_or_path") or None
