"""Pretrained weights read into a model wrapped with LoRA adapters: PEFT's ``get_peft_model`` (a wrapped projection
holds its weight as ``q_proj.base_layer.weight``, beside ``q_proj.lora_A.default.weight``) and litgpt's LoRA ``GPT``
(``attn.qkv.linear.weight`` beside ``attn.qkv.lora_A``). The published file names the weight as the unwrapped model
does (``q_proj.weight``): each base layer's tensors are matched under that name, and the adapters' own tensors are
in no pretrained file, so they keep their own initialization (``lora_B`` zero: the wrapped model starts as the
pretrained one).

Adapters whose initialization reads the base weights (DoRA's magnitude, PiSSA, OLoRA, LoftQ, EVA, CorDA: computed
when ``get_peft_model`` runs, before the weights are read), other PEFT methods (IA3, LoHa, ...) and PEFT's
``modules_to_save`` copies are refused by name (:func:`unsupported_adapters`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from lightning_dist.compat.peft import BASE_LAYER, is_adapter_layer, why_not_read_into

_LITGPT_LORA = "litgpt.lora"
_LITGPT_BASE = "linear"


@dataclass(frozen=True)
class AdapterLayout:
    """Where a model's LoRA wrappers sit: ``wrappers`` maps each wrapped layer's qualified name to the child that
    holds its base layer (``"base_layer"``, ``"linear"``)."""

    wrappers: Mapping[str, str]

    def split(self, name: str) -> tuple[str, bool]:
        """``name`` as the unwrapped model calls it, and whether it is an adapter's own tensor (in no pretrained
        file)."""
        parts = name.split(".")
        for end in range(len(parts) - 1, 0, -1):
            owner = ".".join(parts[:end])
            base = self.wrappers.get(owner)
            if base is None:
                continue
            if parts[end] == base:
                return ".".join(parts[:end] + parts[end + 1 :]), False
            return name, True
        return name, False

    def file_names(self, names: Iterable[str]) -> dict[str, str]:
        """The unwrapped name of each of ``names`` that is not an adapter's own (``{name: unwrapped}``)."""
        out = {}
        for name in names:
            unwrapped, adapter = self.split(name)
            if not adapter:
                out[name] = unwrapped
        return out

    def adapter_names(self, names: Iterable[str]) -> list[str]:
        """The adapters' own tensors among ``names``."""
        return [name for name in names if self.split(name)[1]]

    def unwrapped(self, state: Mapping[str, object]) -> dict[str, object]:
        """``state`` under the unwrapped model's names, adapters left out (the values are the same objects)."""
        return {unwrapped: state[name] for name, unwrapped in self.file_names(state).items()}


def adapter_layout(model: nn.Module) -> AdapterLayout:
    """The LoRA wrappers of ``model`` (PEFT's adapter layers, litgpt's ``LoRALinear``)."""
    wrappers: dict[str, str] = {}
    litgpt_lora = _litgpt_lora_class()
    for name, module in model.named_modules():
        if is_adapter_layer(module):
            wrappers[name] = BASE_LAYER
        elif litgpt_lora is not None and isinstance(module, litgpt_lora):
            wrappers[name] = _LITGPT_BASE
    return AdapterLayout(wrappers)


def unsupported_adapters(model: nn.Module) -> list[str]:
    """What of ``model``'s PEFT adapters pretrained weights cannot be read under (a line each, naming the layer and
    the method); empty when every adapter is a LoRA whose own init does not read the base weights."""
    lines: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ == "ModulesToSaveWrapper" and type(module).__module__.startswith("peft."):
            lines.append(
                f"{name}: PEFT's modules_to_save copy of a pretrained layer (made when get_peft_model ran, before"
                " the weights are read)"
            )
            continue
        if not is_adapter_layer(module):
            continue
        why = why_not_read_into(module, model)
        if why is not None:
            lines.append(f"{name}: {why}")
    return lines


def _litgpt_lora_class() -> type | None:
    loaded = sys.modules.get(_LITGPT_LORA)
    found = getattr(loaded, "LoRALinear", None) if loaded is not None else None
    return found if isinstance(found, type) else None
