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
ZEROPP_LOSS_REL_TOLERANCE = 5e-2  # ZeRO++ quantizes weights (int8) and gradients (int4) on purpose (README)


@dataclass(frozen=True)
class Column:
    """A matrix column: a strategy on ``devices`` CPU processes.

    Attributes:
        label: The registered name a user passes as ``strategy=`` (the column's title and selector).
        devices: Processes.
        batch_replicas: Data-parallel ranks (the sampler's replicas); tensor, context and pipeline peers share a batch.
        mesh: The mesh, as the table shows it.
        options: Hybrid3DStrategy's sizes (empty: the registered name with its own defaults).
        quantized: The strategy quantizes its collectives on purpose (ZeRO++): losses are compared relatively, with
            :data:`ZEROPP_LOSS_REL_TOLERANCE`, and parameters are not compared.
    """

    label: str
    devices: int
    batch_replicas: int
    mesh: str
    options: dict[str, int] = field(default_factory=dict)
    quantized: bool = False

    def make(self) -> Any:
        """The ``strategy=`` argument: the registered name, or Hybrid3DStrategy with the column's sizes."""
        if not self.options:
            return self.label
        from lightning_dist import Hybrid3DStrategy

        return Hybrid3DStrategy(**self.options)


COLUMNS: dict[str, Column] = {
    column.label: column
    for column in (
        Column("fsdp2", 2, 2, "dp_shard=2"),
        Column("fsdp2_activation_checkpointing", 2, 2, "dp_shard=2, blocks recomputed"),
        Column("zeropp", 2, 2, "dp_shard=2; qwZ int8, hpZ, qgZ int4", quantized=True),
        Column("tensor_parallel", 2, 1, "tp=2"),
        Column("tensor_parallel_sequence_parallel", 2, 1, "tp=2, norms on sequence shards"),
        Column("pipeline", 2, 1, "pp=2, 1F1B"),
        Column("pipeline_zero_bubble", 2, 1, "pp=2, 2 stages per rank, ZBV"),
        Column("context_parallel", 2, 1, "cp=2, ring attention, zigzag"),
        Column("context_parallel_ulysses", 2, 1, "cp=2, heads all-to-all"),
        Column("hybrid3d", 4, 1, "pp=2 × tp=2", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
    )
}
# The six families' default names, plus the presets that change what the strategy does with the model's structure:
# which modules are recomputed (activation checkpointing), which are sharded on the sequence (sequence parallel), a
# finer cut with a different backward (zero bubble: 4 stages, V-schedule), attention over all-to-all'd heads (GQA
# head counts, Ulysses). Left out, because the model's part of them is its family column's (the suite covers the
# rest on the example GPT): presets that change only how the same units communicate or where their state lives
# (fsdp2_grad_op, fsdp2_no_shard, fsdp2_hybrid, fsdp2_cpu_offload, zeropp_qwz, zeropp_hpz, zeropp_qgz), another
# schedule over the same or the same-size cut (pipeline_gpipe, pipeline_interleaved), another ring-free K/V exchange
# (context_parallel_allgather), and tensor_parallel_2d (tensor_parallel × fsdp2 on 4 ranks). Each cell costs 5-20 s
# on 2 shared cores, and a failure after launch costs a new launch (30-60 s).

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
    column: Column, losses: list[float], reference_losses: list[float], param_diff: float | None
) -> dict[str, Any]:
    """A trained cell against one process: parity when every per-step loss and every final parameter is within the
    tolerance (ZeRO++: the losses, relatively), else a defect."""
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
        ok, measure = diff <= FP64_TOLERANCE, "max. difference"
        result = {"loss_diff": loss_diff, "param_diff": param_diff}
        tolerance = FP64_TOLERANCE
    result.update(max_diff=diff, outcome="parity" if ok else "defect")
    if not ok:
        result["defect"] = f"differs from one process: {measure} {diff:.1e} > {tolerance:.0e}"
    return result
