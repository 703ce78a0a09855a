"""The strategy names registered with Lightning's ``StrategyRegistry``: one primary name per strategy, plus variants
in Lightning's ``<base>_<variant>`` style that preset some options."""

from __future__ import annotations

import difflib
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies.context_parallel import ContextParallelStrategy
from lightning_dist.strategies.fsdp2 import FSDP2Strategy
from lightning_dist.strategies.hybrid3d import Hybrid3DStrategy
from lightning_dist.strategies.pipeline import PipelineStrategy
from lightning_dist.strategies.tensor_parallel import TensorParallelStrategy
from lightning_dist.strategies.zeropp import ZeroPPStrategy

# name, class, description, preset options
STRATEGY_NAMES: list[tuple[str, type, str, dict[str, Any]]] = [
    ("fsdp2", FSDP2Strategy, "FSDP2: fully sharded data parallel (ZeRO-3)", {}),
    (
        "fsdp2_grad_op",
        FSDP2Strategy,
        "FSDP2, parameters kept gathered until backward (ZeRO-2-like)",
        {"sharding": "grad_op"},
    ),
    ("fsdp2_no_shard", FSDP2Strategy, "FSDP2 without sharding (replicated, DDP-like)", {"sharding": "no_shard"}),
    (
        "fsdp2_hybrid",
        FSDP2Strategy,
        "FSDP2 hybrid sharding (HSDP): shard within a node, replicate across nodes",
        {"sharding": "hybrid"},
    ),
    (
        "fsdp2_cpu_offload",
        FSDP2Strategy,
        "FSDP2 with parameters, gradients and optimizer state offloaded to CPU",
        {"cpu_offload": True},
    ),
    (
        "fsdp2_activation_checkpointing",
        FSDP2Strategy,
        "FSDP2 with activation checkpointing of every block",
        {"activation_checkpointing": True},
    ),
    (
        "expert_parallel",
        FSDP2Strategy,
        "FSDP2 with expert parallelism: every process holds 1/N of each MoE layer's experts (all-to-all dispatch)",
        {"expert_parallel_size": "auto"},
    ),
    ("zeropp", ZeroPPStrategy, "ZeRO++ on FSDP2: quantized weights (qwZ), hpZ and qgZ", {}),
    (
        "zeropp_qwz",
        ZeroPPStrategy,
        "ZeRO++ with quantized weight all-gather (qwZ) only",
        {"hpz_partition_size": None, "quantized_gradients": False},
    ),
    (
        "zeropp_hpz",
        ZeroPPStrategy,
        "ZeRO++ with the hierarchical (intra-node) secondary weight partition (hpZ) only",
        {"quantized_weights": False, "quantized_gradients": False},
    ),
    (
        "zeropp_qgz",
        ZeroPPStrategy,
        "ZeRO++ with the quantized two-hop gradient reduce-scatter (qgZ) only",
        {"quantized_weights": False, "hpz_partition_size": None},
    ),
    ("tensor_parallel", TensorParallelStrategy, "Tensor parallelism with an automatic plan (all devices on tp)", {}),
    (
        "tensor_parallel_2d",
        TensorParallelStrategy,
        "2D: tensor parallelism × FSDP2 over data parallel (TP inside a node by default)",
        {"data_parallel_shard_size": "auto"},
    ),
    (
        "tensor_parallel_sequence_parallel",
        TensorParallelStrategy,
        "Tensor parallelism with sequence parallel norms",
        {"sequence_parallel": True},
    ),
    (
        "context_parallel",
        ContextParallelStrategy,
        "Context parallelism: ring attention over the sequence shards (zigzag load balancing)",
        {},
    ),
    (
        "context_parallel_allgather",
        ContextParallelStrategy,
        "Context parallelism: key/value all-gather attention (as Llama 3)",
        {"attention": "allgather"},
    ),
    (
        "context_parallel_ulysses",
        ContextParallelStrategy,
        "Context parallelism: Ulysses all-to-all over heads (contiguous layout)",
        {"attention": "ulysses"},
    ),
    ("pipeline", PipelineStrategy, "Pipeline parallelism, 1F1B schedule (all devices on pp)", {}),
    ("pipeline_gpipe", PipelineStrategy, "Pipeline parallelism, GPipe schedule", {"schedule": "gpipe"}),
    (
        "pipeline_interleaved",
        PipelineStrategy,
        "Pipeline parallelism, interleaved 1F1B with 2 stages per rank",
        {"schedule": "interleaved_1f1b", "stages_per_rank": 2},
    ),
    (
        "pipeline_zero_bubble",
        PipelineStrategy,
        "Pipeline parallelism, zero-bubble ZBV schedule (2 stages per rank, V placement)",
        {"schedule": "zbv_zero_bubble"},
    ),
    (
        "hybrid3d",
        Hybrid3DStrategy,
        "Any mesh of pp × dp_replicate × dp_shard × cp × tp (sizes, mesh_shape or mesh='auto')",
        {},
    ),
]


def register_strategies() -> None:
    """Register every lightning_dist strategy name; a second call (re-import) is a no-op.

    Lightning's built-in names are never overridden: ours all carry their own prefixes.
    """
    for name, cls, description, presets in STRATEGY_NAMES:
        if name in StrategyRegistry:
            if StrategyRegistry[name]["strategy"] is not cls:
                raise RuntimeError(f"The strategy name {name!r} is already registered by another package.")
            continue
        StrategyRegistry.register(name, cls, description=description, **presets)


def unknown_strategy_message(name: str) -> str:
    """Say that ``name`` is not a registered strategy name, suggest the closest one, and list ours and Lightning's."""
    ours = [entry[0] for entry in STRATEGY_NAMES]
    lightnings = [n for n in StrategyRegistry.available_strategies() if n not in ours]
    close = difflib.get_close_matches(name, ours, n=1) or difflib.get_close_matches(name, lightnings, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"strategy={name!r} is not a registered strategy name.{hint} lightning_dist registers: {', '.join(ours)}."
        f" Lightning's own include auto, {', '.join(n for n in lightnings if 'unused' not in n)}."
    )
