"""What lightning_dist reads of PEFT's layers (checked on peft 0.21.2): a LoRA-wrapped ``nn.Linear`` and why another
adapter layer cannot be sharded.

PEFT is optional and never imported here: a model holds PEFT layers only once PEFT has been imported, so its classes
are looked up in ``sys.modules``. Everything read is PEFT's public layer API (``peft.tuners.lora.Linear``,
``peft.tuners.tuners_utils.BaseTunerLayer``, the ``base_layer``/``lora_A``/``lora_B``/``lora_dropout`` children,
``lora_variant``, ``lora_magnitude_vector``); :data:`PRIVATE_PEFT_NAMES` lists no private name.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from torch import nn

PEFT_CHECKED = "peft 0.21.2"
#: Every private PEFT name used below (none): ``name -> (checked on, used for)``, as the other compat tables.
PRIVATE_PEFT_NAMES: dict[str, tuple[str, str]] = {}

BASE_LAYER = "base_layer"
LORA_A = "lora_A"
LORA_B = "lora_B"
LORA_DROPOUT = "lora_dropout"


@dataclass(frozen=True)
class LoraLinear:
    """A LoRA-wrapped linear layer, ``base_layer(x) + lora_B[a](lora_A[a](lora_dropout[a](x))) * scaling[a]`` for
    each adapter ``a``, by child name.

    Attributes:
        base: The wrapped layer (``"base_layer"``).
        adapters: ``(lora_A child, lora_B child, dropout child)`` per adapter, e.g.
            ``("lora_A.default", "lora_B.default", "lora_dropout.default")``.
    """

    base: str
    adapters: tuple[tuple[str, str, str], ...]


def own_class(module: nn.Module) -> type:
    """The module's own class: FSDP2's ``fully_shard`` swaps a module's class for a subclass made on the fly
    (``FSDPLinear``), which no ``type(module) is`` test recognizes."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed"))


def _peft_class(module: str, name: str) -> type | None:
    loaded = sys.modules.get(module)
    found = getattr(loaded, name, None) if loaded is not None else None
    return found if isinstance(found, type) else None


def is_adapter_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of PEFT's adapter layers (LoRA, IA3, LoHa, ...: any ``BaseTunerLayer``)."""
    tuner = _peft_class("peft.tuners.tuners_utils", "BaseTunerLayer")
    return tuner is not None and isinstance(module, tuner)


def lora_linear(module: nn.Module) -> LoraLinear | None:
    """The parts of ``module`` if it is a LoRA-wrapped linear layer whose adapters are plain low-rank products
    (``None`` for anything else, :func:`why_adapter_is_whole` says why)."""
    if why_adapter_is_whole(module) is not None or not is_adapter_layer(module):
        return None
    names = sorted(getattr(module, LORA_A).keys())
    return LoraLinear(
        base=BASE_LAYER,
        adapters=tuple((f"{LORA_A}.{a}", f"{LORA_B}.{a}", f"{LORA_DROPOUT}.{a}") for a in names),
    )


def why_adapter_is_whole(module: nn.Module) -> str | None:
    """Why the PEFT adapter layer ``module`` cannot be sharded as its base layer (``None`` when it can, or when it is
    no adapter layer)."""
    if not is_adapter_layer(module):
        return None
    if (why := _not_plain_lora(module, _UNSHARDABLE)) is not None:
        return why
    a, b = getattr(module, LORA_A), getattr(module, LORA_B)
    pairs = sorted(a.keys()) == sorted(b.keys())
    if not pairs or any(own_class(m) is not nn.Linear for m in (*a.values(), *b.values())):
        return "a LoRA layer whose lora_A/lora_B are not pairs of nn.Linear"
    return None


#: Why an adapter layer is not plain LoRA, for the tensor-parallel plan and for ``initial_weights``: when it is not
#: LoRA's Linear (``{name}``, ``{module}``: its class), when it is a LoRA variant (DoRA).
_UNSHARDABLE = {
    "method": "a PEFT {name} adapter layer ({module}); only LoRA's Linear (peft.tuners.lora.Linear) is sharded like"
    " its base layer",
    "variant": "a LoRA variant (DoRA or another `lora_variant`): its adapter is not a plain low-rank product that the"
    " base layer's split applies to",
}
_UNREADABLE = {
    "method": "a PEFT {name} layer ({module}): initial_weights reads pretrained weights under LoRA's Linear layers"
    " (peft.tuners.lora.Linear) only",
    "variant": "a LoRA variant (DoRA or another `lora_variant`): its magnitude is computed from the base weight when"
    " get_peft_model runs, before initial_weights are read",
}


def _not_plain_lora(module: nn.Module, reasons: dict[str, str]) -> str | None:
    """The reason (of ``reasons``) the adapter layer ``module`` is not LoRA's plain Linear, or ``None``."""
    cls = own_class(module)
    lora = _peft_class("peft.tuners.lora", "Linear")
    if lora is None or cls is not lora:
        kind = "method"
    elif getattr(module, "lora_variant", None) or len(getattr(module, "lora_magnitude_vector", ())):
        kind = "variant"
    else:
        return None
    return reasons[kind].format(name=cls.__name__, module=cls.__module__)


def lora_base(module: nn.Module) -> nn.Module | None:
    """The wrapped layer of a LoRA-wrapped linear layer (``None`` for anything else)."""
    return getattr(module, BASE_LAYER) if lora_linear(module) is not None else None


#: ``init_lora_weights`` values whose adapters do not depend on the base weights (PEFT's default, its Gaussian
#: variant, and ``False``: the adapter layers' own ``nn.Linear`` init).
_INITS_WITHOUT_BASE = (True, False, "gaussian")


def adapter_configs(model: nn.Module) -> dict[str, object]:
    """Adapter name → its PEFT config, from the ``peft_config`` of the PEFT models (or tuners) inside ``model``."""
    found: dict[str, object] = {}
    for module in model.modules():
        configs = getattr(module, "peft_config", None)
        if isinstance(configs, dict) and own_class(module).__module__.startswith("peft."):
            found.update(configs)
    return found


def is_peft_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``peft.PeftModel`` (what ``get_peft_model`` returns)."""
    peft_model = _peft_class("peft", "PeftModel") or _peft_class("peft.peft_model", "PeftModel")
    return peft_model is not None and isinstance(module, peft_model)


def why_not_read_into(module: nn.Module, model: nn.Module) -> str | None:
    """Why pretrained weights read after the model was built cannot give the adapter layer ``module`` (inside
    ``model``) what ``get_peft_model`` on the pretrained model would (``None`` when they can, or when it is no
    adapter layer): its method, or its init, depends on the base weights."""
    if not is_adapter_layer(module):
        return None
    if (why := _not_plain_lora(module, _UNREADABLE)) is not None:
        return why
    configs = adapter_configs(model)
    for adapter in sorted(getattr(module, LORA_A).keys()):
        init = getattr(configs.get(adapter), "init_lora_weights", True)
        if not any(init is allowed or init == allowed for allowed in _INITS_WITHOUT_BASE):
            return (
                f"LoRA init_lora_weights={init!r} (adapter {adapter!r}) computes the adapters from the base weights"
                " when get_peft_model runs, before initial_weights are read"
            )
    return None


def initialize_lora_adapters(model: nn.Module) -> int:
    """Give every LoRA adapter of ``model`` PEFT's own initialization again (``reset_lora_parameters``: ``lora_A``
    Kaiming-uniform or Gaussian, ``lora_B`` zero), after a meta-device model was materialized and its modules'
    ``reset_parameters`` and the transformers init drew other values into them. Returns how many adapters."""
    configs = adapter_configs(model)
    count = 0
    for module in model.modules():
        if lora_linear(module) is None:
            continue
        for adapter in sorted(getattr(module, LORA_A).keys()):
            init = getattr(configs.get(adapter), "init_lora_weights", True)
            if init is False:  # PEFT leaves the adapter layers' own nn.Linear init
                getattr(module, LORA_A)[adapter].reset_parameters()
                getattr(module, LORA_B)[adapter].reset_parameters()
            else:
                module.reset_lora_parameters(adapter, init)
            count += 1
    return count


def peft_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``peft.PeftModel``s inside ``module`` (itself included), by qualified name."""
    return [(name, sub) for name, sub in module.named_modules() if is_peft_model(sub)]


def lora_record(name: str, model: nn.Module) -> dict[str, object]:
    """What an export needs of the PEFT model ``model`` (at ``name`` in the module), as plain data: its active
    adapter, the adapter's config as ``adapter_config.json`` holds it, and each LoRA layer's ``scaling`` and
    ``fan_in_fan_out`` (by name under the base model), the factors PEFT's merge multiplies ``lora_B @ lora_A`` by.
    ``{"format": "peft", "prefix": "model.", "base_prefix": "model.base_model.model.", "adapter": "default",
    "config": {...}, "layers": {"model.layers.0.self_attn.q_proj": [2.0, False], ...}}``"""
    prefix = f"{name}." if name else ""
    adapter = model.active_adapter  # type: ignore[attr-defined]
    base = "base_model.model."  # PeftModel.base_model (the tuner) .model (the wrapped model)
    layers: dict[str, list[object]] = {}
    for layer_name, layer in model.named_modules():
        if lora_linear(layer) is not None and adapter in getattr(layer, LORA_A):
            relative = layer_name.removeprefix(base)
            layers[relative] = [float(layer.scaling[adapter]), bool(getattr(layer, "fan_in_fan_out", False))]
    config = model.peft_config[adapter].to_dict()  # type: ignore[attr-defined,index]
    return {
        "format": "peft",
        "class": type(model).__name__,
        "prefix": prefix,
        "base_prefix": prefix + base,
        "adapter": adapter,
        "config": json.loads(json.dumps(config, default=_plain)),
        "layers": layers,
    }


def _plain(value: object) -> object:
    """JSON for what a PEFT config's ``to_dict`` holds beside plain data: sets (target modules) and enums."""
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value, key=str)
    return str(getattr(value, "value", value))
