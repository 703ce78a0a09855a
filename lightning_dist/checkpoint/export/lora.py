"""A LoRA checkpoint (PEFT's ``get_peft_model``) seen as the model it wraps, with each adapter merged into its base
weight as PEFT's ``merge_and_unload()`` merges it: ``W + scaling · (B @ A)`` (transposed for a ``fan_in_fan_out``
layer), ``scaling`` being the one the layer trained with (recorded in the checkpoint). The adapters' own names
(``lora_A``, ``lora_B``) are left out and ``q_proj.base_layer.weight`` is named ``q_proj.weight``; an export reads it
as it reads any checkpoint, one shard at a time. The adapter alone, for ``--format peft``: :mod:`.peft`."""

from __future__ import annotations

from typing import Any

import torch

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.export.source import TensorSource

_BASE = "base_layer."


def lora_record(provenance: dict[str, Any], prefix: str | None = None) -> dict[str, Any] | None:
    """The checkpoint's record of a PEFT model (the one around ``prefix``, the base model's, when given)."""
    from lightning_dist.checkpoint.export.model_configs import PRETRAINED_CONFIGS_KEY

    records = [r for r in provenance.get(PRETRAINED_CONFIGS_KEY) or [] if isinstance(r, dict)]
    records = [r for r in records if r.get("format") == "peft" and isinstance(r.get("layers"), dict)]
    if prefix is not None:
        records = [r for r in records if prefix.startswith(r.get("base_prefix", "\0"))]
    return records[0] if len(records) == 1 else None


class MergedLora:
    """The tensors of ``source`` (a checkpoint of a PEFT model, described by ``record``) as the merged model's."""

    def __init__(self, source: TensorSource, record: dict[str, Any]) -> None:
        self.source, self.path, self.provenance = source, source.path, source.provenance
        base, adapter = record["base_prefix"], record["adapter"]
        self.merges: dict[str, tuple[str, str, str, float, bool]] = {}
        layers = {f"{base}{name}." for name in record["layers"]}
        for name, (scaling, fan_in_fan_out) in record["layers"].items():
            layer = f"{base}{name}."
            parts = (f"{layer}{_BASE}weight", f"{layer}lora_A.{adapter}.weight", f"{layer}lora_B.{adapter}.weight")
            missing = [part for part in parts if part not in source.specs]
            if missing:
                raise CheckpointError(
                    f"The checkpoint's LoRA layer {name!r} lacks {', '.join(missing)}: it is not the PEFT model its"
                    " record describes."
                )
            self.merges[f"{layer}weight"] = (*parts, float(scaling), bool(fan_in_fan_out))
        self.renamed: dict[str, str] = {}  # merged model's name -> checkpoint name, for everything not merged
        for key in source.specs:
            layer = next((prefix for prefix in layers if key.startswith(prefix)), None)
            if layer is None:
                self.renamed[key] = key
            elif key.startswith(layer + _BASE) and key != f"{layer}{_BASE}weight":
                self.renamed[layer + key[len(layer + _BASE) :]] = key  # the base layer's bias
        self.specs = {name: source.specs[key] for name, key in self.renamed.items()}
        self.specs.update({name: source.specs[parts[0]] for name, parts in self.merges.items()})

    def nbytes(self, name: str) -> int:
        if name in self.merges:
            return self.source.nbytes(self.merges[name][0])
        return self.source.nbytes(self.renamed[name])

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        needed = {
            key for name in names for key in (self.merges[name][:3] if name in self.merges else [self.renamed[name]])
        }
        values = self.source.read(sorted(needed))
        out = {}
        for name in names:
            if name not in self.merges:
                out[name] = values[self.renamed[name]]
                continue
            base, a, b, scaling, fan_in_fan_out = self.merges[name]
            out[name] = merged_weight(values[base], values[a], values[b], scaling, fan_in_fan_out)
        return out


def merged_weight(
    base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, fan_in_fan_out: bool
) -> torch.Tensor:
    """``base + scaling · (B @ A)`` in the base weight's dtype, computed in at least float32."""
    work = torch.promote_types(base.dtype, torch.float32)
    delta = lora_b.to(work) @ lora_a.to(work)
    if fan_in_fan_out:
        delta = delta.T
    return (base.to(work) + delta * scaling).to(base.dtype)
