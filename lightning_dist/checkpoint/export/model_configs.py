"""The configs of the pretrained models inside a module, saved into each checkpoint's provenance so an export can
write them back (``config.json`` of a Hugging Face model, ``model_config.yaml`` of a litgpt ``GPT``).

Each record is plain data, so weights-only unpickling reads it: ``{"format": "hf" | "litgpt", "class": class name,
"prefix": the module's attribute path with a trailing dot ("model.", "" for the module itself), "config": dict}``,
and for a PEFT model one of :func:`~lightning_dist.compat.peft.lora_record`'s (``"format": "peft"``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.compat.peft import lora_record, own_class, peft_models

#: The key of the records in our provenance entry.
PRETRAINED_CONFIGS_KEY = "pretrained_configs"
#: The key of the folder the trained weights came from (``initial_weights``), where an export finds the tokenizer.
WEIGHTS_ORIGIN_KEY = "initial_weights"


def weights_origin(initial_weights: str | os.PathLike | None) -> str | None:
    """The absolute path of ``initial_weights`` as a checkpoint records it (its folder for a single file)."""
    if initial_weights is None:
        return None
    return str(Path(initial_weights).expanduser().absolute())


def pretrained_configs(module: nn.Module) -> list[dict[str, Any]]:
    """A record for every outermost Hugging Face ``PreTrainedModel`` and litgpt ``GPT`` in ``module``. Imports neither
    library: a model of one can only exist when it was imported."""
    records: list[dict[str, Any]] = [lora_record(name, model) for name, model in peft_models(module)]
    taken: list[str] = []
    for name, submodule in module.named_modules():
        if any(name.startswith(outer) for outer in taken):
            continue  # LlamaModel inside LlamaForCausalLM
        record = _record(submodule)
        if record is not None:
            prefix = f"{name}." if name else ""
            records.append({**record, "prefix": prefix})
            taken.append(prefix)
    return records


def _record(module: nn.Module) -> dict[str, Any] | None:
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(module, transformers.PreTrainedModel):
        config = json.loads(module.config.to_json_string(use_diff=False))
        return {"format": "hf", "class": own_class(module).__name__, "config": config}
    if _is_litgpt_gpt(module):
        config = json.loads(json.dumps(dataclasses.asdict(module.config)))  # type: ignore[arg-type]
        # the module tells litgpt's LoRA GPT (litgpt.lora) from its plain one (litgpt.model)
        cls = own_class(module)  # not FSDP2's swapped class: the model is the root a Fabric loop shards
        return {"format": "litgpt", "class": cls.__name__, "module": cls.__module__, "config": config}
    return None


def _is_litgpt_gpt(module: nn.Module) -> bool:
    cls = own_class(module)
    config = getattr(module, "config", None)
    return cls.__module__.split(".")[0] == "litgpt" and cls.__name__ == "GPT" and dataclasses.is_dataclass(config)


#: The file a ``--config`` folder holds, per format.
CONFIG_FILES = {"hf": "config.json", "litgpt": "model_config.yaml"}


def find_config(
    provenance: dict[str, Any], fmt: str, prefix: str | None = None, config_path: str | os.PathLike | None = None
) -> dict[str, Any]:
    """The record (as :func:`pretrained_configs` writes) of the model to export as ``fmt``: from ``config_path`` (a
    config file, or a folder holding one: ``prefix`` then unknown unless given) when given, else the checkpoint's
    record of that format (the one under ``prefix`` when several are)."""
    if config_path is not None:
        return {"format": fmt, "class": None, "prefix": prefix, "config": _read_config_file(Path(config_path), fmt)}
    records = [
        r for r in provenance.get(PRETRAINED_CONFIGS_KEY) or [] if isinstance(r, dict) and r.get("format") == fmt
    ]
    if prefix is not None:
        records = [r for r in records if r.get("prefix") == prefix] or records[:0]
    kind = {"hf": "Hugging Face PreTrainedModel", "litgpt": "litgpt GPT"}[fmt]
    if not records:
        raise CheckpointError(
            f"The checkpoint holds no config of a {kind}{'' if prefix is None else f' under {prefix!r}'}: it was"
            f" saved before lightning_dist recorded model configs, or its model is not a {kind}. Give the model's"
            f" config with --config PATH (a {CONFIG_FILES[fmt]}, or a folder holding one)."
        )
    if len(records) > 1:
        prefixes = ", ".join(repr(r.get("prefix")) for r in records)
        raise CheckpointError(f"The checkpoint holds several {kind} models ({prefixes}): choose one with --prefix.")
    return records[0]


def _read_config_file(path: Path, fmt: str) -> dict[str, Any]:
    file = path / CONFIG_FILES[fmt] if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"No model config at {str(file)!r}: --config takes a {CONFIG_FILES[fmt]} or its folder.")
    try:
        text = file.read_text(encoding="utf-8")
        config = json.loads(text) if fmt == "hf" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise CheckpointError(f"Cannot read the model config {str(file)!r}: {err}") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"The model config {str(file)!r} holds a {type(config).__name__}, not a mapping.")
    return config
