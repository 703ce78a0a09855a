"""What lightning_dist reads of PEFT's layers (checked on peft 0.21.2): a LoRA-wrapped ``nn.Linear`` and why another
adapter layer cannot be sharded.

PEFT is optional and never imported here: a model holds PEFT layers only once PEFT has been imported, so its classes
are looked up in ``sys.modules``. Everything read is PEFT's public layer API (``peft.tuners.lora.Linear``,
``peft.tuners.tuners_utils.BaseTunerLayer``, the ``base_layer``/``lora_A``/``lora_B``/``lora_dropout`` children,
``lora_variant``, ``lora_magnitude_vector``); :data:`PRIVATE_PEFT_NAMES` lists no private name.
"""

from __future__ import annotations

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
    kind = type(module).__name__
    lora = _peft_class("peft.tuners.lora", "Linear")
    if lora is None or type(module) is not lora:
        return (
            f"a PEFT {kind} adapter layer ({type(module).__module__}); only LoRA's Linear (peft.tuners.lora.Linear)"
            " is sharded like its base layer"
        )
    if getattr(module, "lora_variant", None) or len(getattr(module, "lora_magnitude_vector", ())):
        return (
            "a LoRA variant (DoRA or another `lora_variant`): its adapter is not a plain low-rank product that the"
            " base layer's split applies to"
        )
    a, b = getattr(module, LORA_A), getattr(module, LORA_B)
    pairs = sorted(a.keys()) == sorted(b.keys())
    if not pairs or any(type(m) is not nn.Linear for m in (*a.values(), *b.values())):
        return "a LoRA layer whose lora_A/lora_B are not pairs of nn.Linear"
    return None


def lora_base(module: nn.Module) -> nn.Module | None:
    """The wrapped layer of a LoRA-wrapped linear layer (``None`` for anything else)."""
    return getattr(module, BASE_LAYER) if lora_linear(module) is not None else None
