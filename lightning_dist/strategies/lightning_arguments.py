"""Lightning ``FSDPStrategy``'s arguments read as ``FSDP2Strategy``'s options, and a DeepSpeed ZeRO++ config (what
``DeepSpeedStrategy(config=...)`` takes) read as ``ZeroPPStrategy``'s: the one place where those vocabularies map onto
ours, so that a project swaps the class name and keeps its arguments.

Each argument becomes the option that does what Lightning's does (``sharding_strategy`` → ``sharding``,
``auto_wrap_policy`` → ``wrap_modules``, ``activation_checkpointing_policy`` → ``activation_checkpointing=[classes]``, ``state_dict_type``
→ the checkpoint format, ``cpu_offload`` → ``cpu_offload``, ``device_mesh`` → the mesh sizes, ``mixed_precision`` →
the precision plugin that sets FSDP2's policy); arguments FSDP2 has
no use for are accepted with a note; what cannot be mapped is refused by name with the way to say it here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from lightning_dist.compat.torch import wrap_policy_classes

#: FSDP1 sharding strategies (their enum names, as strings too) → ``sharding`` (and ``reshard_after_forward``).
SHARDING_STRATEGIES: dict[str, dict[str, Any]] = {
    "FULL_SHARD": {"sharding": "full"},
    "SHARD_GRAD_OP": {"sharding": "grad_op"},
    "NO_SHARD": {"sharding": "no_shard"},
    "HYBRID_SHARD": {"sharding": "hybrid"},
    "_HYBRID_SHARD_ZERO2": {"sharding": "hybrid", "reshard_after_forward": False},
}
#: Arguments with no meaning under FSDP2 (it always uses original parameters, limits its own all-gathers and
#: prefetches by itself; every rank builds the same model and the strategy makes replicated state equal).
NO_MEANING = {
    "limit_all_gathers": "FSDP2 bounds its in-flight all-gathers itself",
    "use_orig_params": "FSDP2 always trains the original parameters (DTensor shards)",
    "sync_module_states": "replicated state is made equal at setup by the strategy itself",
    "forward_prefetch": "FSDP2 prefetches the next unit's all-gather by itself",
    "backward_prefetch": "FSDP2 prefetches the next unit's all-gather by itself",
}


#: The arguments of Lightning's ``FSDPStrategy`` that ``FSDP2Strategy`` does not have under the same name.
FSDP_STRATEGY_ONLY = {"sharding_strategy", "auto_wrap_policy", "activation_checkpointing_policy", "state_dict_type",
                      "device_mesh", "mixed_precision", *NO_MEANING}  # fmt: skip


def speaks_fsdp_strategy(cpu_offload: Any, options: dict[str, Any]) -> bool:
    """Whether ``FSDP2Strategy``'s arguments hold any of Lightning ``FSDPStrategy``'s own (names, or values of the
    shared names that only it takes: a ``CPUOffload``, activation checkpointing as classes)."""
    return (
        bool(FSDP_STRATEGY_ONLY & options.keys())
        or hasattr(cpu_offload, "offload_params")  # FSDP's CPUOffload
        or _is_classes(options.get("activation_checkpointing"))
    )


def from_fsdp_strategy_arguments(arguments: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``arguments`` (keyword arguments given to ``FSDP2Strategy``) with Lightning ``FSDPStrategy``'s names replaced by
    ours, and one note per argument accepted without effect. Raises ``ValueError`` for a value that cannot be
    mapped, saying how to write it here."""
    options, notes = dict(arguments), []
    if "sharding_strategy" in options:
        options.update(_sharding(options.pop("sharding_strategy"), options))
    policy = options.pop("auto_wrap_policy", None)
    if policy is not None:
        options["wrap_modules"] = _classes("auto_wrap_policy", policy)
    checkpointed = options.pop("activation_checkpointing_policy", None)
    if checkpointed is None and _is_classes(options.get("activation_checkpointing")):
        checkpointed = options.pop("activation_checkpointing")  # Lightning's older spelling: a class or classes
    if checkpointed is not None:
        options.update(_checkpointing(checkpointed))
    if "state_dict_type" in options:
        options.update(_state_dict_type(options.pop("state_dict_type"), options.get("checkpoint_io")))
    if hasattr(options.get("cpu_offload"), "offload_params"):  # FSDP's CPUOffload(offload_params=...)
        options["cpu_offload"] = bool(options["cpu_offload"].offload_params)
    if "device_mesh" in options:
        options.update(_device_mesh(options.pop("device_mesh")))
    if options.get("mixed_precision") is not None:
        plugin, note = _mixed_precision(options.pop("mixed_precision"), options.get("precision_plugin"))
        options["precision_plugin"] = plugin
        notes.append(note)
    options.pop("mixed_precision", None)
    for name, why in NO_MEANING.items():
        if name in options:
            notes.append(f"{name}={options.pop(name)!r} accepted without effect: {why}")
    return options, notes


def _sharding(value: Any, options: dict[str, Any]) -> dict[str, Any]:
    name = getattr(value, "name", value)
    mapped = SHARDING_STRATEGIES.get(str(name).upper()) if isinstance(name, str) else None
    if mapped is None:
        raise ValueError(
            f"sharding_strategy={value!r} is not one of FSDP's {list(SHARDING_STRATEGIES)}; or give FSDP2Strategy's"
            " own sharding='full' | 'grad_op' | 'no_shard' | 'hybrid'."
        )
    if options.get("sharding", "full") not in ("full", mapped["sharding"]):  # "full": FSDP2Strategy's default
        raise ValueError(f"sharding_strategy={value!r} and sharding={options['sharding']!r} disagree: give one.")
    return mapped


def _is_classes(value: Any) -> bool:
    return isinstance(value, type) or (
        isinstance(value, (set, list, tuple, frozenset)) and bool(value) and all(isinstance(v, type) for v in value)
    )


def _classes(argument: str, value: Any) -> list[type]:
    """The module classes of a Lightning policy argument: a class, a set or list of classes, or a
    ``ModuleWrapPolicy``; anything else (a size-based or custom callable policy) is refused."""
    if _is_classes(value):
        return sorted({value} if isinstance(value, type) else set(value), key=lambda c: c.__qualname__)
    classes = wrap_policy_classes(value)
    if classes:
        return sorted(classes, key=lambda c: c.__qualname__)
    raise ValueError(
        f"{argument}={value!r}: FSDP2Strategy shards (and checkpoints) whole modules chosen by class; a size-based or"
        " custom callable policy cannot be mapped. Give the classes of the repeated blocks, as a set or"
        " ModuleWrapPolicy({Block}), or FSDP2Strategy's wrap_modules=[Block] / wrap_regex='blocks\\\\.\\\\d+'."
    )


def _checkpointing(value: Any) -> dict[str, Any]:
    """Lightning checkpoints the activations of every instance of the given classes: so does
    ``activation_checkpointing=[classes]`` here."""
    return {"activation_checkpointing": _classes("activation_checkpointing_policy", value)}


#: FSDP's ``MixedPrecision`` dtypes as this package's precision flags (its parameters' compute dtype) and FSDP2
#: reduce dtypes.
_PRECISION_FLAGS = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed", torch.float32: "32-true",
                    torch.float64: "64-true", None: "32-true"}  # fmt: skip
_REDUCE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", None: None}


def _mixed_precision(value: Any, given_plugin: Any) -> tuple[Any, str]:
    """FSDP's ``MixedPrecision(param_dtype, reduce_dtype, ...)`` as FSDP2's policy: the precision plugin that sets
    it (the Trainer's ``precision=`` is then not used, as with Lightning's ``FSDPStrategy(mixed_precision=...)``)."""
    from lightning_dist.plugins.zeropp_precision import ZeroPPPrecision

    param, reduce = getattr(value, "param_dtype", "?"), getattr(value, "reduce_dtype", "?")
    if given_plugin is not None or param not in _PRECISION_FLAGS or reduce not in _REDUCE_NAMES:
        raise ValueError(
            f"mixed_precision={value!r}: give FSDP's MixedPrecision(param_dtype=..., reduce_dtype=...) with dtypes"
            " among bf16, fp16, fp32 and no precision_plugin beside it, or use the Trainer's precision='bf16-mixed'"
            " (bf16 compute, fp32 parameters and reductions) and drop mixed_precision."
        )
    flag, reduce_dtype = _PRECISION_FLAGS[param], _REDUCE_NAMES[reduce]
    note = (
        f"mixed_precision=MixedPrecision(param_dtype={param}, reduce_dtype={reduce}) read as precision={flag!r}"
        f" with reduce_dtype={reduce_dtype!r} (FSDP2's MixedPrecisionPolicy); the Trainer's precision= is not used,"
        " as with Lightning's FSDPStrategy; buffer_dtype has no effect (FSDP2 does not cast buffers)"
    )
    return ZeroPPPrecision(flag, reduce_dtype=reduce_dtype if flag.endswith("-mixed") else None), note


def _state_dict_type(value: Any, checkpoint_io: Any) -> dict[str, Any]:
    from lightning_dist.plugins import FullStateCheckpointIO

    if value == "sharded":
        return {}
    if value == "full":
        return {"checkpoint_io": checkpoint_io or FullStateCheckpointIO()}
    raise ValueError(f"state_dict_type={value!r} is not 'full' or 'sharded' (Lightning's values).")


def _device_mesh(value: Any) -> dict[str, Any]:
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return {"data_parallel_replicate_size": value[0], "data_parallel_shard_size": value[1]}
    raise ValueError(
        f"device_mesh={value!r}: give it as Lightning's (replicate, shard) sizes tuple, or as FSDP2Strategy's"
        " data_parallel_replicate_size=... and data_parallel_shard_size=... (the strategy builds the mesh itself)."
    )


#: DeepSpeed ``zero_optimization`` keys that only size or schedule DeepSpeed's own buffers: no meaning under FSDP2.
DEEPSPEED_TUNING = {
    "reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "overlap_comm", "contiguous_gradients",
    "sub_group_size", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
    "stage3_gather_16bit_weights_on_model_save", "zero_hpz_partition_size_fallback", "memory_efficient_linear",
}  # fmt: skip
#: Top-level DeepSpeed keys the Trainer or the LightningModule owns here: accepted, with where each is set.
DEEPSPEED_TRAINER_KEYS = {
    "train_batch_size": "the DataLoader's batch size × data-parallel ranks",
    "train_micro_batch_size_per_gpu": "the DataLoader's batch size",
    "gradient_accumulation_steps": "Trainer(accumulate_grad_batches=...)",
    "gradient_clipping": "Trainer(gradient_clip_val=...)",
    "bf16": "Trainer(precision='bf16-mixed')",
    "fp16": "Trainer(precision='16-mixed')",
    "optimizer": "configure_optimizers",
    "scheduler": "configure_optimizers",
    "steps_per_print": "the Trainer's logging",
    "wall_clock_breakdown": "the Trainer's profiler",
    "zero_allow_untested_optimizer": "any torch optimizer works",
}


def from_deepspeed_config(config: dict[str, Any] | str | os.PathLike) -> tuple[dict[str, Any], list[str]]:
    """``ZeroPPStrategy``'s options from a DeepSpeed config (a dict or a JSON file) with ZeRO stage 3 and its ZeRO++
    keys, and one note per key accepted without effect. Raises ``ValueError`` for a key with no meaning here."""
    if not isinstance(config, dict):
        path = Path(config)
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"config={str(path)!r}: not a readable DeepSpeed JSON config ({err}).") from None
        if not isinstance(config, dict):
            raise ValueError(f"config={str(path)!r}: a DeepSpeed config is a JSON object, not {type(config).__name__}.")
    notes = [f"config key {key!r} accepted without effect: set by {DEEPSPEED_TRAINER_KEYS[key]}"
             for key in config if key in DEEPSPEED_TRAINER_KEYS]  # fmt: skip
    unknown = sorted(key for key in config if key not in DEEPSPEED_TRAINER_KEYS and key != "zero_optimization")
    zero = dict(config.get("zero_optimization") or {})
    if zero.get("stage") != 3:
        raise ValueError(
            f"config: zero_optimization.stage={zero.get('stage')!r}: ZeRO++ is ZeRO stage 3 (set it to 3). For stage 2"
            " use FSDP2Strategy(sharding='grad_op'); for stage 1 or 0, FSDP2Strategy(sharding='no_shard')."
        )
    options: dict[str, Any] = {
        "quantized_weights": bool(zero.pop("zero_quantized_weights", False)),
        "quantized_gradients": bool(zero.pop("zero_quantized_gradients", False)),
    }
    hpz = zero.pop("zero_hpz_partition_size", 1)
    options["hpz_partition_size"] = None if hpz in (None, 1) else hpz  # DeepSpeed's 1 is hpZ off
    offloaded = [zero.pop(key, None) for key in ("offload_param", "offload_optimizer")]
    devices = {str((o or {}).get("device", "none")).lower() for o in offloaded}
    if devices - {"none", "cpu"}:
        raise ValueError(f"config: offload to {sorted(devices - {'none', 'cpu'})} is not supported: offload to 'cpu'.")
    options["cpu_offload"] = "cpu" in devices
    zero.pop("stage")
    notes += [f"config key 'zero_optimization.{key}' accepted without effect: it sizes or schedules DeepSpeed's own"
              " buffers"
              for key in zero if key in DEEPSPEED_TUNING]  # fmt: skip
    unknown += sorted(f"zero_optimization.{key}" for key in zero if key not in DEEPSPEED_TUNING)
    if unknown:
        raise ValueError(
            f"config: {', '.join(map(repr, unknown))} {'has' if len(unknown) == 1 else 'have'} no meaning for"
            " ZeroPPStrategy. Its ZeRO++ keys are"
            " zero_optimization.{stage: 3, zero_quantized_weights, zero_hpz_partition_size, zero_quantized_gradients,"
            " offload_param, offload_optimizer}; remove the others, or give ZeroPPStrategy's own options by name."
        )
    return options, notes
