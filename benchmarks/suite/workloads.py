"""What is measured: every configuration of the suite, in one list, and the pairs whose step times are compared.

A workload is either one of lightning_dist's registered strategy names (looked up in Lightning's
``StrategyRegistry`` when the suite runs, so strategies merged later — ``tensor_parallel``, ``zeropp`` — are picked
up by name; a name that is not registered is reported as *not available in this build*), a Lightning built-in
(``ddp``), or a hand-written baseline (:mod:`benchmarks.suite.baselines`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from benchmarks.common.layout import Layout

Kind = Literal["registered", "model_parallel_fsdp", "model_parallel_tp", "raw_fsdp"]
Family = Literal["zero3", "ddp", "tp", "zeropp"]


def layout_for(world_size: int, device: str = "cpu") -> Layout:
    """On CPU, world size 4 runs as 2 simulated nodes × 2 ranks (ZeRO++'s cross-node figures need more than one
    node); smaller worlds are one node. On CUDA every rank needs a GPU of its own (``cuda:LOCAL_RANK``), so the run is
    one node: simulated nodes would put two ranks on one GPU."""
    if device == "cuda":
        return Layout(world_size, num_nodes=1)
    return Layout(world_size, num_nodes=2 if world_size >= 4 and world_size % 2 == 0 else 1)


def _no_options(layout: Layout) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Workload:
    """One measured configuration.

    Attributes:
        name: Label in the tables.
        kind: How it is run (a registered strategy name, a hand-written baseline, or the raw loop).
        family: Which theory it is compared with (``zero3``, ``ddp``, ``tp``, ``zeropp``).
        strategy: The registered strategy name (``kind="registered"``).
        options: Extra strategy constructor arguments for a layout (``kind="registered"``).
        activation_checkpointing: Whether the workload recomputes block activations (for the activation table).
        lightning_dist: Whether the strategy name comes from lightning_dist (else a Lightning built-in).
        description: One line for the report.
    """

    name: str
    kind: Kind
    family: Family
    description: str
    strategy: str | None = None
    options: Callable[[Layout], dict[str, Any]] = field(default=_no_options, compare=False)
    activation_checkpointing: bool = False
    lightning_dist: bool = True


WORKLOADS: tuple[Workload, ...] = (
    Workload("fsdp2", "registered", "zero3", "lightning_dist FSDP2Strategy (no configure_model)", strategy="fsdp2"),
    Workload(
        "fsdp2_ac",
        "registered",
        "zero3",
        "fsdp2 with activation checkpointing of every block",
        strategy="fsdp2_activation_checkpointing",
        activation_checkpointing=True,
    ),
    Workload(
        "mp_fsdp",
        "model_parallel_fsdp",
        "zero3",
        "Lightning ModelParallelStrategy + hand-written configure_model (fully_shard blocks, then root)",
    ),
    Workload("raw_fsdp", "raw_fsdp", "zero3", "plain PyTorch loop with fully_shard, no Lightning"),
    Workload("ddp", "registered", "ddp", "Lightning DDPStrategy", strategy="ddp", lightning_dist=False),
    Workload(
        "tensor_parallel",
        "registered",
        "tp",
        "lightning_dist TensorParallelStrategy (automatic plan; tp = ranks per node, FSDP2 over nodes, as mp_tp)",
        strategy="tensor_parallel",
        options=lambda layout: {
            "tensor_parallel_size": layout.ranks_per_node,
            "data_parallel_shard_size": layout.num_nodes,
        },
    ),
    Workload(
        "mp_tp",
        "model_parallel_tp",
        "tp",
        "Lightning ModelParallelStrategy + hand-written parallelize_module plan (tp = ranks per node, FSDP2 over"
        " nodes when more than one)",
    ),
    Workload("zeropp", "registered", "zeropp", "lightning_dist ZeroPPStrategy (qwZ + hpZ + qgZ)", strategy="zeropp"),
)

# (ours, baseline): step-time ratios reported as ours / baseline.
TIME_COMPARISONS: tuple[tuple[str, str], ...] = (
    ("fsdp2", "mp_fsdp"),
    ("fsdp2", "raw_fsdp"),
    ("fsdp2", "ddp"),
    ("tensor_parallel", "mp_tp"),
    ("zeropp", "fsdp2"),
)

BY_NAME: dict[str, Workload] = {w.name: w for w in WORKLOADS}


def availability(workload: Workload) -> str | None:
    """``None`` if the workload can run in this build, else the reason it cannot (for the report)."""
    if workload.kind != "registered":
        return None
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_dist  # noqa: F401  (registers the names)

    if workload.strategy not in StrategyRegistry:
        return f"not available in this build (strategy name {workload.strategy!r} is not registered)"
    return None


def timed_workloads(comparisons: tuple[tuple[str, str], ...] = TIME_COMPARISONS) -> list[str]:
    """Names that take part in a time comparison, in first-appearance order."""
    names: list[str] = []
    for pair in comparisons:
        names += [n for n in pair if n not in names]
    return names
