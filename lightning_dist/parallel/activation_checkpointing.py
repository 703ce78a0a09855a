"""Activation checkpointing without changing parameter names, as users ask for it: every unit (``True``), every k-th
unit (an int: torchtitan's per-layer selective mode), the modules of some classes (Lightning's
``activation_checkpointing_policy``), or every unit keeping the outputs of its matmuls and attention and recomputing
the rest (``"selective"``: torchtitan's per-op mode, on torch's selective checkpoint API)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from lightning_dist.compat import composable_checkpoint

#: What the ``activation_checkpointing`` option takes.
ActivationCheckpointing = bool | int | Literal["selective"] | list[type[nn.Module] | str]
SELECTIVE = "selective"


def check_activation_checkpointing(value: Any) -> bool | int | str | tuple[type[nn.Module] | str, ...]:
    """The option, checked: ``False``/``True``, an int k >= 1 (every k-th unit; 1 is every unit), ``"selective"``,
    or a list of module classes or class names."""
    if isinstance(value, bool) or value == SELECTIVE:
        return value
    if isinstance(value, int) and value >= 1:
        return True if value == 1 else value
    if isinstance(value, (list, tuple, set, frozenset)) and value and all(
        isinstance(v, str) or (isinstance(v, type) and issubclass(v, nn.Module)) for v in value
    ):
        return tuple(value)
    raise TypeError(
        f"activation_checkpointing={value!r} must be True or False (every unit the strategy shards, or none), an int"
        f" k (every k-th unit), {SELECTIVE!r} (every unit, keeping its matmul and attention outputs), or a list of"
        " module classes (or class names) whose every module is checkpointed."
    )


def checkpointed_modules(
    model: nn.Module, units: Sequence[tuple[str, nn.Module]], spec: Any
) -> list[tuple[str, nn.Module]]:
    """The modules ``spec`` (a checked option) checkpoints: units, every k-th unit, or the outermost modules of the
    given classes."""
    if spec is True or spec == SELECTIVE:
        return list(units)
    if isinstance(spec, int) and not isinstance(spec, bool):
        return [unit for index, unit in enumerate(units) if (index + 1) % spec == 0]
    if isinstance(spec, tuple):
        chosen: list[tuple[str, nn.Module]] = []
        for name, module in model.named_modules():
            matches = any(type(module).__name__ == c if isinstance(c, str) else isinstance(module, c) for c in spec)
            if name and matches and not any(name.startswith(f"{outer}.") for outer, _ in chosen):
                chosen.append((name, module))
        return chosen
    return []


def selective_saved_ops() -> set[Any]:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention (the costly ones to recompute)."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm"]  # fmt: skip
    return {getattr(aten, name).default for name in names if hasattr(aten, name)}


def _keep_matmuls_and_attention(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if func in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


_SAVED = selective_saved_ops()


def apply_activation_checkpointing(
    model: nn.Module, units: Sequence[tuple[str, nn.Module]], spec: Any = True
) -> list[tuple[str, nn.Module]]:
    """Recompute the activations of the modules ``spec`` chooses in backward instead of storing them (``"selective"``:
    keeping their matmul and attention outputs). Returns the modules checkpointed.

    Uses the composable (hook-based) API so state-dict keys stay the same as the unwrapped model's, which keeps
    checkpoints interchangeable between runs with and without activation checkpointing.
    """
    options: dict[str, Any] = {}
    if spec == SELECTIVE:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention)
    chosen = checkpointed_modules(model, units, spec)
    for _, module in chosen:
        composable_checkpoint(module, **options)
    return chosen


def turn_off_generation_cache(model: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` on every Hugging Face config in ``model`` that has it on; returns the names of
    the modules whose config changed.

    A decoder that fills a key/value cache during forward (T5's stack builds an ``EncoderDecoderCache`` whenever
    ``use_cache`` is on) saves different tensors when a checkpointed block is recomputed, and torch refuses the
    backward. transformers turns the cache off itself under its own gradient checkpointing; ours wraps the blocks
    from outside, so it must do the same. Generation afterwards can pass ``use_cache=True`` again.
    """
    changed, seen = [], set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or getattr(config, "use_cache", None) is not True:
            continue
        seen.add(id(config))
        config.use_cache = False
        changed.append(name or type(module).__name__)
    return changed
