"""Tensor-parallel plans as transformers writes them: a model's shipped plan (``config.base_model_tp_plan``, relative to
the base model, and the head's ``_tp_plan``, relative to the ``*ForCausalLM``) and the style names transformers uses,
read as this package's plan (:mod:`.plan`).

transformers 5.24's styles and what each becomes here: ``colwise`` and ``rowwise`` as ours; ``colwise_gather_output``
(an output head whose logits are gathered) is ``colwise`` with a replicated output; ``embedding_rowwise`` is
``rowwise`` on an ``nn.Embedding`` with its token ids replicated; ``sequence_parallel`` and ``replicate`` as ours. The others are refused by name
with the reason (``packed_colwise`` and ``moe_tp_experts`` shard 3-D expert weights, the ``local_*`` styles keep plain
tensors, ``gather`` and ``isolated`` have no counterpart, and ``replicated_with_grad_allreduce`` marks a per-head
norm whose gradient the automatic plan sums over tp itself: give ``plan=None`` for such models).
"""

from __future__ import annotations

from typing import Any

from torch import nn

#: transformers' style names read as ours (the ones both spell alike are ours already).
HUGGING_FACE_STYLES: dict[str, Any] = {
    "colwise_gather_output": {"style": "colwise", "output_layouts": "replicate"},
    "embedding_rowwise": {"style": "rowwise", "input_layouts": "replicate"},  # token ids arrive whole
}
#: transformers' styles that cannot be read as ours, and why.
UNSUPPORTED_HUGGING_FACE_STYLES = {
    "packed_colwise": "it shards a packed 3-D expert weight; plan=None (the automatic plan) keeps experts whole",
    "moe_tp_experts": "experts are split by expert_parallel_size here, not by tensor parallelism",
    "local_colwise": "it keeps plain local tensors; use 'colwise'",
    "local_rowwise": "it keeps plain local tensors; use 'rowwise'",
    "local_packed_rowwise": "it keeps plain local tensors",
    "gather": "it has no counterpart here",
    "isolated": "it has no counterpart here",
    "replicated_with_grad_allreduce": (
        "a per-head norm whose gradient must be summed over tp: plan=None (the automatic plan) does that"
    ),
}
#: ``plan="model"``: the plan the model ships with.
MODEL_PLAN = "model"


def from_hugging_face_style(spec: Any) -> Any:
    """``spec`` with a transformers style name replaced by ours (anything else as it is)."""
    return HUGGING_FACE_STYLES.get(spec, spec) if isinstance(spec, str) else spec


def unsupported_style_reason(spec: Any) -> str | None:
    """Why a transformers style cannot be read here (``None``: it can)."""
    return UNSUPPORTED_HUGGING_FACE_STYLES.get(spec) if isinstance(spec, str) else None


def shipped_plan(model: nn.Module) -> dict[str, Any]:
    """The tensor-parallel plan the Hugging Face models inside ``model`` ship with, keyed by names in ``model``: each
    outermost ``PreTrainedModel``'s base model plan (``config.base_model_tp_plan``) under its base model's name, and
    its own ``_tp_plan`` (the head) under its name. Empty when there is none."""
    plan: dict[str, Any] = {}
    outer: list[str] = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if getattr(config, "base_model_tp_plan", None) is None or any(name.startswith(f"{o}.") for o in outer if o):
            continue
        if outer and "" in outer:
            break
        outer.append(name)
        base = getattr(module, "base_model", module)
        base_name = next((n for n, m in model.named_modules() if m is base), name)
        for key, style in (config.base_model_tp_plan or {}).items():
            plan[_joined(base_name, key)] = style
        for key, style in (getattr(module, "_tp_plan", None) or {}).items():
            plan[_joined(name, key)] = style
    return plan


def _joined(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
