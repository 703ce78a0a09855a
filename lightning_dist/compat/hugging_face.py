"""Private Hugging Face transformers attributes lightning_dist reads, with the version they were checked on."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

#: Every private name used below: ``name -> (checked on, used for)``. tests/test_compat.py checks the list is complete.
PRIVATE_HUGGING_FACE_NAMES: dict[str, tuple[str, str]] = {
    "_attn_implementation": ("transformers 5.24", "context parallel: refuse attention that does not call SDPA"),
    "_experts_implementation": ("transformers 5.24", "expert parallel / pipeline: which experts kernel runs"),
    "_apply_gate": ("transformers 5.24", "expert parallel: an experts module's own act(gate) * up"),
    "_CAN_RECORD_REGISTRY": ("transformers 5.24", "verify: output capture of a model unpickled in a new process"),
    "_can_record_outputs": ("transformers 5.24", "verify: output capture of a model unpickled in a new process"),
    "_is_hf_initialized": ("transformers 5.24", "materialize: the mark that makes initialize_weights skip a module"),
}


def has_own_experts_gate(experts: Any) -> bool:
    """Whether an experts class splits its gate/up projection itself (an ``_apply_gate`` of its own, as gpt-oss's
    interleaved layout needs), rather than with transformers' default chunking into halves."""
    gate = getattr(type(experts), "_apply_gate", None)
    return gate is not None and gate.__name__ != "_default_apply_gate"


def router_loss_requested(module: Any) -> str | None:
    """The name of the first submodule of ``module`` whose transformers config asks for the router's auxiliary loss
    (``output_router_logits=True``), or ``None``."""
    for name, submodule in module.named_modules():
        if getattr(getattr(submodule, "config", None), "output_router_logits", False) is True:
            return name or type(submodule).__name__
    return None


def router_logit_recorders(module: Any) -> list[tuple[type, int]]:
    """``(router class, index of the logits in its output)`` for every transformers model in ``module``: what its
    output capture records as ``router_logits`` (``_can_record_outputs``, transformers 5.x)."""
    found: list[tuple[type, int]] = []
    for submodule in module.modules():
        spec = (getattr(submodule, "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None:
            continue
        target = spec if isinstance(spec, type) else getattr(spec, "target_class", None)
        index = 0 if isinstance(spec, type) else getattr(spec, "index", 0)
        if isinstance(target, type) and (target, index) not in found:
            found.append((target, index))
    return found


def restore_output_capture(module: Any) -> list[str]:
    """Register again the recordable outputs (router logits, hidden states, attentions) of ``module``'s transformers
    models; returns their class names.

    transformers records them in a process-wide registry when a model is constructed. A model unpickled in a new
    process was never constructed there: its forward then skips output capture without a word (``router_logits``
    is ``None`` and the router's auxiliary loss the int 0).
    """
    import sys

    if "transformers" not in sys.modules:  # a model of transformers would have imported it while unpickling
        return []
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    restored = []
    for submodule in module.modules():
        outputs = getattr(submodule, "_can_record_outputs", None)
        if outputs is not None and not _CAN_RECORD_REGISTRY.get(submodule):
            _CAN_RECORD_REGISTRY[submodule] = outputs
            restored.append(type(submodule).__name__)
    return restored


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


# ---------------------------------------------------------------------------------------------------- weight init
def pretrained_models(module: Any) -> list[Any]:
    """The outermost transformers ``PreTrainedModel`` instances in ``module`` (``module`` itself, if it is one)."""
    # A transformers model's class would have loaded transformers' modeling module; importing it here for a model
    # of the user's own would cost most of a second and load torchao, with its warnings, in every process.
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return []
    pretrained_model = modeling.PreTrainedModel
    found: list[Any] = []
    stack = [module]
    while stack:
        current = stack.pop()
        if isinstance(current, pretrained_model):
            found.append(current)
        else:
            stack.extend(reversed(list(current.children())))
    return found


def initialize_pretrained_weights(model: Any) -> None:
    """Run a transformers model's own weight initialization on its (materialized) state, as its constructor does
    outside the meta device: ``initialize_weights()`` applies the model's ``_init_weights`` to every module, sub-models
    dispatching to their own (norm weights to one, rotary ``inv_freq`` recomputed from the config, experts and routers
    drawn with the config's ``initializer_range``). Weight tying is left to the caller.

    Modules marked as already initialized (``_is_hf_initialized``, set by an earlier init or by ``from_pretrained``)
    would be skipped: the marks are cleared first, since materializing replaced every tensor."""
    for submodule in model.modules():
        if getattr(submodule, "_is_hf_initialized", False):
            submodule._is_hf_initialized = False
    model.initialize_weights()


# ---------------------------------------------------------------------------------------------------- generation cache
def generation_cache_configs(module: Any) -> list[Any]:
    """The transformers configs in ``module`` with the key/value cache on (``use_cache=True``, the default of every
    decoder config), each once."""
    if "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedConfig

    found: dict[int, Any] = {}
    for submodule in module.modules():
        config = getattr(submodule, "config", None)
        if isinstance(config, PreTrainedConfig) and getattr(config, "use_cache", None) is True:
            found.setdefault(id(config), config)
    return list(found.values())


@contextmanager
def generation_cache_off(configs: Sequence[Any]) -> Iterator[None]:
    """Within it, ``use_cache=False`` on each config; on exit, each config's value from before."""
    before = [config.use_cache for config in configs]
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config, value in zip(configs, before):
            config.use_cache = value


@contextmanager
def packed_sequences_not_detected() -> Iterator[None]:
    """Within it, Hugging Face's masks take ``position_ids`` as they are. Called without an attention mask and
    without a key/value cache (training with ``use_cache=False``), transformers 5 reads positions that do not count
    up by one as packed sequences and builds a block mask (``masking_utils.find_packed_sequence_indices``): a
    context-parallel shard's global positions (zigzag: two chunks of the sequence) are one sequence, and a mask on
    some ranks only made them send other sizes than their peers (a collective mismatch). A no-op until transformers'
    masking module is imported."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking.find_packed_sequence_indices = _no_packed_sequences
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _no_packed_sequences(position_ids: Any) -> None:
    return None


# ---------------------------------------------------------------------------------------------------- checkpoint names
def checkpoint_conversions(module: Any) -> tuple[list[tuple[str, str]], list[tuple[tuple[str, ...], str, bool]]]:
    """How the ``PreTrainedModel``s in ``module`` name their weights on disk where that differs from their parameters
    (transformers 5 converts at ``from_pretrained`` and back at ``save_pretrained``): ``(renamings, stackings)``.

    - a renaming ``(on_disk, in_model)``: a substring of the names (Mixtral's ``.block_sparse_moe.`` is ``.mlp.``);
    - a stacking ``(sources, target, concatenated)``: a stacked experts parameter (``mlp.experts.gate_up_proj``)
      made of one tensor per expert and source (``mlp.experts.*.gate_proj.weight``, ``*`` the expert index), stacked
      on a new dim 0 and, when ``concatenated``, the sources concatenated on dim 1.

    Other conversions (quantization, permutations for rotary, splits) are not reported: a name they change stays
    unmatched and is refused by name."""
    renamings: list[tuple[str, str]] = []
    stackings: list[tuple[tuple[str, ...], str, bool]] = []
    models = pretrained_models(module)
    if not models:
        return renamings, stackings
    from transformers.conversion_mapping import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        get_model_conversion_mapping,
    )

    for model in models:
        for transform in get_model_conversion_mapping(model, add_legacy=False):
            sources = [p for p in transform.source_patterns if isinstance(p, str)]
            targets = [p for p in transform.target_patterns if isinstance(p, str)]
            if isinstance(transform, WeightRenaming) and len(sources) == len(targets) == 1:
                renamings.append((sources[0], targets[0]))
            elif isinstance(transform, WeightConverter) and len(targets) == 1:
                kinds = [(type(op), getattr(op, "dim", None)) for op in transform.operations]
                if kinds == [(MergeModulelist, 0)] and len(sources) == 1:
                    stackings.append((tuple(sources), targets[0], False))
                elif kinds == [(MergeModulelist, 0), (Concatenate, 1)]:
                    stackings.append((tuple(sources), targets[0], True))
    return renamings, stackings


def saved_layout(model: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` (named as ``model``'s parameters) under the names and in the layout ``save_pretrained`` writes:
    transformers' own reverse conversion (``revert_weight_conversion``: stacked experts split per expert, renamed
    modules named as on disk); meta tensors give the names and shapes alone."""
    from transformers.core_model_loading import revert_weight_conversion

    return dict(revert_weight_conversion(model, dict(tensors)))
