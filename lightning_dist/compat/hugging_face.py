"""Private Hugging Face transformers attributes lightning_dist reads, with the version they were checked on."""

from __future__ import annotations

from typing import Any

#: Every private name used below: ``name -> (checked on, used for)``. tests/test_compat.py checks the list is complete.
PRIVATE_HUGGING_FACE_NAMES: dict[str, tuple[str, str]] = {
    "_attn_implementation": ("transformers 5.24", "context parallel: refuse attention that does not call SDPA"),
}


def attention_implementation(config: Any, default: str = "sdpa") -> str:
    """The attention a Hugging Face model config selects (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``...),
    ``default`` for a config without one."""
    return getattr(config, "_attn_implementation", default)
