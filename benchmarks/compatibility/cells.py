"""The columns of the compatibility matrix (a strategy on a few CPU processes), the tolerances, and what a cell's
outcome means: parity with one process, a refusal (before launch, or at the first step where only the model's
output can tell), or a defect.
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FP64_TOLERANCE = 1e-10  # the package's bar for fp64 on CPU: per-step losses and final parameters
FP32_TOLERANCE = 1e-4  # the bar for a model that computes parts in float32 inside a float64 run (ModelSpec.why_fp32)
ZEROPP_LOSS_REL_TOLERANCE = 5e-2  # ZeRO++ quantizes weights (int8) and gradients (int4) on purpose


@dataclass(frozen=True)
class Column:
    """A strategy on ``devices`` CPU processes (a row of the page's table).

    Attributes:
        label: The registered name a user passes as ``strategy=``; for hybrid3d, ``hybrid3d-<mesh>``.
        devices: Processes.
        batch_replicas: Data-parallel ranks (the sampler's replicas); tensor, context and pipeline peers share a batch.
        mesh: The mesh the strategy must build (``str(ParallelDims)``): a trained cell on another mesh is a defect.
        preset: What the preset changes, for the table.
        options: Hybrid3DStrategy's sizes (empty: the registered name with its own defaults).
        nodes: Simulated nodes (torchrun-style ranks per node): HSDP replicates across nodes.
        quantized: The strategy quantizes its collectives on purpose (ZeRO++ qwZ/qgZ): losses are compared
            relatively, with :data:`ZEROPP_LOSS_REL_TOLERANCE`, and parameters are not compared.
    """

    label: str
    devices: int
    batch_replicas: int
    mesh: str
    preset: str = ""
    options: dict[str, int] = field(default_factory=dict)
    nodes: int = 1
    quantized: bool = False

    @property
    def name(self) -> str:
        """The registered strategy name."""
        return self.label.split("-")[0]

    def make(self) -> Any:
        """The ``strategy=`` argument: the registered name, or Hybrid3DStrategy with the column's sizes."""
        if not self.options:
            return self.label
        from lightning_dist import Hybrid3DStrategy

        return Hybrid3DStrategy(**self.options)


def _hybrid(pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1) -> Column:
    sizes = {"pp": pp, "dp_shard": dp, "cp": cp, "tp": tp}
    mesh = " × ".join(f"{axis}={size}" for axis, size in sizes.items() if size > 1)
    label = "hybrid3d-" + "-".join(f"{axis.split('_')[0]}{size}" for axis, size in sizes.items() if size > 1)
    options = {"pipeline_parallel_size": pp, "data_parallel_shard_size": dp, "context_parallel_size": cp,
               "tensor_parallel_size": tp}  # fmt: skip
    return Column(label, pp * dp * cp * tp, dp, mesh, options=options)


# Every registered name, on the smallest mesh where its preset means something (2 processes; 4 for the two that
# need two axes or two nodes), and hybrid3d on each 4-process pair of pipeline, data, context and tensor parallelism
# that the single strategies do not already give.
COLUMNS: dict[str, Column] = {
    column.label: column
    for column in (
        Column("fsdp2", 2, 2, "dp_shard=2"),
        Column("fsdp2_grad_op", 2, 2, "dp_shard=2", "gathered until backward"),
        Column("fsdp2_no_shard", 2, 2, "dp_replicate=2", "replicated"),
        Column("fsdp2_cpu_offload", 2, 2, "dp_shard=2", "CPU offload"),
        Column("fsdp2_activation_checkpointing", 2, 2, "dp_shard=2", "blocks recomputed"),
        Column("fsdp2_hybrid", 4, 4, "dp_replicate=2 × dp_shard=2", "2 nodes", nodes=2),
        Column("zeropp", 2, 2, "dp_shard=2", "qwZ int8, hpZ, qgZ int4", quantized=True),
        Column("zeropp_qwz", 2, 2, "dp_shard=2", "int8 weight all-gather", quantized=True),
        Column("zeropp_hpz", 2, 2, "dp_shard=2", "secondary weight partition"),
        Column("zeropp_qgz", 2, 2, "dp_shard=2", "int4 gradient reduce-scatter", quantized=True),
        Column("tensor_parallel", 2, 1, "tp=2"),
        Column("tensor_parallel_sequence_parallel", 2, 1, "tp=2", "norms on sequence shards"),
        Column("tensor_parallel_2d", 4, 2, "dp_shard=2 × tp=2"),
        Column("pipeline", 2, 1, "pp=2", "1F1B"),
        Column("pipeline_gpipe", 2, 1, "pp=2", "GPipe"),
        Column("pipeline_interleaved", 2, 1, "pp=2", "2 stages per rank, interleaved 1F1B"),
        Column("pipeline_zero_bubble", 2, 1, "pp=2", "2 stages per rank, ZBV"),
        Column("context_parallel", 2, 1, "cp=2", "ring attention, zigzag"),
        Column("context_parallel_allgather", 2, 1, "cp=2", "all-gathered K/V"),
        Column("context_parallel_ulysses", 2, 1, "cp=2", "heads all-to-all"),
        _hybrid(pp=2, tp=2),
        _hybrid(pp=2, cp=2),
        _hybrid(pp=2, dp=2),
        _hybrid(cp=2, tp=2),
    )
}

# Refusals that may come after launch: only the model's output can tell (a pooled output under context parallel).
# Any other refusal after launch is a defect: the structure or the data already told before launch.
OUTPUT_REFUSALS = ("PooledOutputError",)

_BUG_TYPES = (AssertionError, AttributeError, KeyError, IndexError, NameError, UnboundLocalError, ZeroDivisionError)
_PACKAGE = f"{os.sep}lightning_dist{os.sep}"


def describe_failure(error: BaseException, steps_done: int, constructing: bool = False) -> dict[str, Any]:
    """What an exception out of ``Trainer(...)`` or ``fit`` means for a cell.

    A refusal is an exception lightning_dist raised on purpose: one of its own types, or raised by a ``raise``
    statement of the package (not a bare re-raise), and not a type that signals a bug (``AssertionError``,
    ``KeyError``...). Anything raised elsewhere (torch, transformers) is a defect. A refusal is before launch when it
    came from ``Trainer(...)`` or the strategy's ``preflight`` (the checks a ``devices=N`` run makes in the launching
    process before any other rank starts); at the first step when it came after launch, before any optimizer step,
    and is one of :data:`OUTPUT_REFUSALS`; any other refusal after launch is a defect (the structure or the data
    could have told before launch).

    Returns:
        ``{"outcome": "refused" | "defect", "when": ..., "error": "Type: message"}``.
    """
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1] if frames else None
    line = (last.line or "").strip() if last is not None else ""
    explicit = last is not None and _PACKAGE in last.filename and line.startswith("raise") and line != "raise"
    own_type = type(error).__module__.startswith("lightning_dist")
    deliberate = (explicit or own_type) and not isinstance(error, _BUG_TYPES)
    preflight = any(f.name == "preflight" and _PACKAGE in f.filename for f in frames)
    if constructing or preflight:
        when = "before launch"
    elif steps_done == 0:
        when = "at the first step" if type(error).__name__ in OUTPUT_REFUSALS else "after launch"
    else:
        when = f"at step {steps_done + 1}"
    message = " ".join(str(error).split())
    where = "" if deliberate or last is None else f" (at {Path(last.filename).name}:{last.lineno})"
    refused = deliberate and when in ("before launch", "at the first step")
    result = {"outcome": "refused" if refused else "defect", "when": when,
              "error": f"{type(error).__name__}: {message}{where}"}  # fmt: skip
    if deliberate and not refused:
        result["defect"] = f"refused {when}, where the structure or the data could tell before launch"
    elif not deliberate:
        result["defect"] = f"failed {when}"
    return result


def compare(
    column: Column,
    losses: list[float],
    reference_losses: list[float],
    param_diff: float | None,
    tolerance: float = FP64_TOLERANCE,
) -> dict[str, Any]:
    """A trained cell against one process: parity when every per-step loss and every final parameter is within
    ``tolerance`` (ZeRO++ qwZ/qgZ: the losses, relatively, within :data:`ZEROPP_LOSS_REL_TOLERANCE`), else a defect."""
    if len(losses) != len(reference_losses):
        return {"outcome": "defect", "defect": f"{len(losses)} steps trained, one process {len(reference_losses)}"}
    if column.quantized:
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, reference_losses))
        ok, measure = diff <= ZEROPP_LOSS_REL_TOLERANCE, "relative loss difference"
        result: dict[str, Any] = {"loss_diff": diff}
        tolerance = ZEROPP_LOSS_REL_TOLERANCE
    else:
        loss_diff = max(abs(a - b) for a, b in zip(losses, reference_losses))
        diff = max(loss_diff, param_diff if param_diff is not None else 0.0)
        ok, measure = diff <= tolerance, "max. difference"
        result = {"loss_diff": loss_diff, "param_diff": param_diff}
    result.update(max_diff=diff, outcome="parity" if ok else "defect")
    if not ok:
        result["defect"] = f"differs from one process: {measure} {diff:.1e} > {tolerance:.0e}"
    return result
