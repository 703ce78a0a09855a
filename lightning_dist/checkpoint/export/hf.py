"""A Hugging Face model folder from a checkpoint: ``config.json``, safetensors shards of at most a given size with
their index (``huggingface_hub``'s shard planner and the index metadata ``save_pretrained`` writes), the names of the
model itself (the LightningModule prefix removed) and tied weights written once.

transformers 5 keeps a MoE layer's experts stacked (``mlp.experts.gate_up_proj``, ``down_proj``); ``save_pretrained``
converts them back to the per-expert layout of the published checkpoints (``block_sparse_moe.experts.N.w1``), which
serving tools read, and so does an export by default, with transformers' own reverse conversion. ``from_pretrained``
loads both layouts strictly (checked with a stock Mixtral, transformers 5.24): the stacked one is kept on request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.export.names import find_prefix, map_names
from lightning_dist.checkpoint.export.report import ExportReport
from lightning_dist.checkpoint.export.shards import INDEX_FILE, SHARD_PATTERN
from lightning_dist.checkpoint.export.source import TensorSource
from lightning_dist.checkpoint.export_target import SAFETENSORS_MARKER
from lightning_dist.compat.hugging_face import saved_layout
from lightning_dist.progress import Progress


def plan_hf(source: TensorSource, record: dict[str, Any], report: ExportReport) -> tuple[Any, type, dict[str, str]]:
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
    folder: Path, source: TensorSource, config: Any, model: Any, names: dict[str, str], max_bytes: int,
    report: ExportReport, per_expert: bool = True, progress: bool = False,
) -> list[str]:  # fmt: skip
    """Write the folder's files into ``folder``, one shard's tensors in memory at a time; returns their names.
    ``per_expert``: a mixture-of-experts layer's stacked experts written one tensor per expert and projection, as
    the published checkpoints and ``save_pretrained`` hold them (transformers' own reverse conversion)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    layout = _disk_layout(model, names, source, per_expert)
    meta = {out: torch.empty(shape, dtype=dtype, device="meta") for out, (_, shape, dtype) in layout.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern=SHARD_PATTERN, max_shard_size=max_bytes)
    metadata = {"format": "pt", SAFETENSORS_MARKER: "exported"}
    shown = Progress(int(split.metadata["total_size"]), "export", quiet=not progress)
    for file, outputs in split.filename_to_tensors.items():
        sources = list(dict.fromkeys(layout[out][0] for out in outputs))
        values = source.read([names[name] for name in sources])
        report.held(sum(t.nbytes for t in values.values()))
        written: dict[str, torch.Tensor] = {}
        for name in sources:
            converted = (
                saved_layout(model, {name: values.pop(names[name])}) if per_expert else {name: values.pop(names[name])}
            )
            written.update({out: value for out, value in converted.items() if out in outputs})
        # a stacked tensor's experts are views of one storage, which safetensors refuses to write as such
        save_file(
            {out: written[out].clone(memory_format=torch.contiguous_format) for out in outputs},
            str(folder / file),
            metadata,
        )
        shown.update(sum(meta[out].nbytes for out in outputs))
        del values, written
    shown.close()
    files = list(split.filename_to_tensors)
    if split.is_sharded:  # the index save_pretrained writes
        index = {
            "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        files.append(INDEX_FILE)
    config.to_json_file(str(folder / "config.json"))
    files.append("config.json")
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.to_json_file(str(folder / "generation_config.json"))
        files.append("generation_config.json")
    report.tensors, report.total_bytes = len(layout), int(split.metadata["total_size"])
    return files


def _disk_layout(
    model: Any, names: dict[str, str], source: TensorSource, per_expert: bool
) -> dict[str, tuple[str, torch.Size, torch.dtype]]:
    """Each tensor to write: ``{name in the folder: (the model's name it comes from, shape, dtype)}``."""
    layout = {}
    for name, key in names.items():
        shape, dtype = source.specs[key]
        if not per_expert:
            layout[name] = (name, shape, dtype)
            continue
        for out, value in saved_layout(model, {name: torch.empty(shape, dtype=dtype, device="meta")}).items():
            layout[out] = (name, value.shape, value.dtype)
    return layout


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
