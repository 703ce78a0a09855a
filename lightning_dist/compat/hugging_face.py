"""Private Hugging Face transformers attributes lightning_dist reads, with the version they were checked on."""

from __future__ import annotations

from typing import Any

#: Every private name used below: ``name -> (checked on, used for)``. tests/test_compat.py checks the list is complete.
PRIVATE_HUGGING_FACE_NAMES: dict[str, tuple[str, str]] = {
    "_attn_implementation": ("transformers 5.24", "context parallel: refuse attention that does not call SDPA"),
    "_experts_implementation": ("transformers 5.24", "expert parallel / pipeline: which experts kernel runs"),
    "_apply_gate": ("transformers 5.24", "expert parallel: an experts module's own act(gate) * up"),
}


def attention_implementation(config: Any, default: str = "sdpa") -> str:
    """The attention a Hugging Face model config selects (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``...),
    ``default`` for a config without one."""
    return getattr(config, "_attn_implementation", default)


def experts_implementation(config: Any, default: str = "eager") -> str:
    """The experts kernel a Hugging Face MoE config selects (``"eager"``, ``"grouped_mm"``, ``"batched_mm"``...),
    ``default`` for a config without one."""
    return getattr(config, "_experts_implementation", None) or default


def apply_experts_gate(experts: Any, gate_up_out: Any) -> Any:
    """``act(gate) * up`` as the experts module computes it (transformers' ``_apply_gate``, set by
    ``@use_experts_implementation``; models with another activation layout override it)."""
    return experts._apply_gate(gate_up_out)
