"""A Hugging Face model folder from a checkpoint: ``config.json``, safetensors shards of at most a given size with
their index, the names of the model itself (the LightningModule prefix removed) and tied weights written once.

transformers 5 keeps a MoE layer's experts stacked (``mlp.experts.gate_up_proj``, ``down_proj``); ``from_pretrained``
loads those names strictly (checked with a stock Mixtral, transformers 5.24), so they are written as they are, not in
the per-expert layout (``block_sparse_moe.experts.N.w1``) that ``save_pretrained`` converts them back to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.export.names import find_prefix, map_names
from lightning_dist.checkpoint.export.report import ExportReport
from lightning_dist.checkpoint.export.shards import INDEX_FILE, plan_shards, shard_file_names, shard_index
from lightning_dist.checkpoint.export.source import CheckpointTensors
from lightning_dist.checkpoint.export_target import SAFETENSORS_MARKER


def plan_hf(
    source: CheckpointTensors, record: dict[str, Any], report: ExportReport
) -> tuple[Any, type, dict[str, str]]:
    """The transformers config, the model class and ``{name in the folder: name in the checkpoint}`` (in the model's
    order, tied copies left out where equal to what they are tied to)."""
    config, cls = _config_and_class(record)
    with torch.device("meta"):
        model = cls(config)
    state = model.state_dict(keep_vars=True)
    model_specs = {name: tensor.shape for name, tensor in state.items()}
    copies = _tied_copies(state)
    prefix = record.get("prefix")
    if prefix is None:
        prefix = find_prefix(source.specs, model_specs)
    names = map_names(source.specs, model_specs, prefix, optional=copies)
    for copy, original in copies.items():
        if copy in names and original in names:
            pair = source.read([names[copy], names[original]])
            report.held(sum(t.nbytes for t in pair.values()))
            if not torch.equal(*pair.values()):  # untied in training: both written, and the config says so
                config.tie_word_embeddings = False
                continue
        names.pop(copy, None)
    report.prefix = prefix
    config.architectures = [cls.__name__]
    dtypes = {source.specs[name][1] for name in names.values() if source.specs[name][1].is_floating_point}
    if len(dtypes) == 1:  # what from_pretrained's dtype="auto" builds the model in, as save_pretrained records it
        config.dtype = dtypes.pop()
    return config, model, names


def write_hf(
    folder: Path, source: CheckpointTensors, config: Any, model: Any, names: dict[str, str], max_bytes: int,
    report: ExportReport,
) -> list[str]:  # fmt: skip
    """Write the folder's files into ``folder``, one shard's tensors in memory at a time; returns their names."""
    from safetensors.torch import save_file

    shards = plan_shards([(out, name, source.nbytes(name)) for out, name in names.items()], max_bytes)
    files = shard_file_names(len(shards))
    metadata = {"format": "pt", SAFETENSORS_MARKER: "exported"}
    for shard, file in zip(shards, files):
        tensors = source.read([name for _, name in shard.entries])
        report.held(sum(t.nbytes for t in tensors.values()))
        save_file({out: tensors[name].contiguous() for out, name in shard.entries}, str(folder / file), metadata)
        del tensors
    if len(shards) > 1:
        (folder / INDEX_FILE).write_text(json.dumps(shard_index(shards, files), indent=2) + "\n", encoding="utf-8")
        files.append(INDEX_FILE)
    config.to_json_file(str(folder / "config.json"))
    files.append("config.json")
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.to_json_file(str(folder / "generation_config.json"))
        files.append("generation_config.json")
    report.tensors, report.total_bytes = len(names), sum(s.nbytes for s in shards)
    return files


def _config_and_class(record: dict[str, Any]) -> tuple[Any, type]:
    try:
        import transformers
    except ImportError as err:
        raise ImportError("--format hf needs the `transformers` package: pip install transformers") from err
    values = dict(record["config"])
    if "model_type" not in values:
        raise CheckpointError("The model config has no 'model_type': it is not a Hugging Face config.json.")
    try:
        config = transformers.AutoConfig.for_model(**values)
    except Exception as err:
        raise CheckpointError(
            f"transformers cannot build a config of model_type {values['model_type']!r}: {err}"
        ) from err
    name = record.get("class") or (values.get("architectures") or [None])[0]
    if name is None:
        if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
            raise CheckpointError(
                f"The config names no model class ('architectures'), and {values['model_type']!r} has no causal LM"
                " class in transformers: give a config.json whose 'architectures' names the class."
            )
        return config, transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type):
        raise CheckpointError(
            f"The model class {name!r} is not one of transformers': give a config.json whose 'architectures' names"
            " a transformers class (--config)."
        )
    return config, cls


def _tied_copies(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{copy: original}`` for names that hold the same parameter (the first name in the model's order is kept)."""
    first: dict[int, str] = {}
    copies: dict[str, str] = {}
    for name, tensor in state.items():
        key = id(tensor)
        if key in first:
            copies[name] = first[key]
        else:
            first[key] = name
    return copies
