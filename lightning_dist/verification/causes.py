"""Likely causes of a verify difference, from what the package can tell: which quantity differed first, whether
copies of a parameter disagree between ranks, and what the user's module code reads."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import Any

from torch import nn

from lightning_dist.verification.compare import Row

# Modules whose classes are not the user's: their code is not searched for rank reads.
_LIBRARIES = ("torch", "lightning", "pytorch_lightning", "lightning_dist", "torchmetrics", "transformers", "litgpt")
_RANK_ATTRIBUTES = {"global_rank", "local_rank", "node_rank"}
_RANK_CALLS = {"get_rank", "get_node_local_rank"}
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def likely_causes(
    rows: list[Row], model: nn.Module | None, ours: dict[str, Any] | None = None, ref: dict[str, Any] | None = None
) -> list[str]:
    """Sentences naming the likely cause of the first difference among ``rows`` (empty when none differs);
    ``ours`` and ``ref`` are the first rank's records of each run (their first step's module calls)."""
    first = next((row for row in rows if not row.ok), None)
    if first is None:
        return []
    if first.quantity in ("replicas", "gradient replicas"):
        name = first.worst[0][0] if first.worst else "a parameter"
        what = "gradient" if first.quantity == "gradient replicas" else "value"
        cause = (
            f"the {what} of {name!r} differs between ranks of the strategy ({first.detail}), though every rank holds"
            " the same parameter: its gradient was not reduced over the data-parallel ranks (the strategy skipped"
            " the reduction, or code changes it on some ranks only)."
        )
        return [cause]
    if first.quantity == "sample replicas":
        cause = (
            f"{first.detail}: the loader splits the data by the global rank or the world size. Build its sampler"
            " from trainer.strategy.distributed_sampler_kwargs (num_replicas and rank count data-parallel ranks"
            " only), or let Lightning put in its own (use_distributed_sampler=True)."
        )
        return [cause]
    causes = []
    before_update = first.when in ("train batch 0", "step 0") and (
        first.quantity == "loss" or first.quantity.startswith(("logged", "gradient"))
    )
    if first.quantity.startswith("logged") and _loss_matches(rows, first.when):
        name = first.quantity.removeprefix("logged ")
        cause = (
            f"{name!r} differs although the loss matches: it is computed per rank and logged without a reduction."
            f" Log it with self.log({name!r}, ..., sync_dist=True), or log a torchmetrics Metric object."
        )
        return [cause]
    if before_update and ours is not None and ref is not None and "cp=" in ours["meta"]["mesh"]:
        reduced = reduced_before(ours["calls"], ref["calls"])
        if reduced:
            causes.append(reduced)
    if before_update:
        reads = rank_reads(model) if model is not None else []
        causes += [f"the module's code reads the rank, so each rank computes something else: {r}" for r in reads]
        if model is not None and any(isinstance(m, _BATCH_NORMS) for m in model.modules()):
            causes.append("BatchNorm normalizes over each rank's part of the batch; use nn.SyncBatchNorm.")
        if not causes and first.quantity == "loss":
            causes.append(
                "the first loss differs before any update: the forward computes differently under the strategy (an"
                " output that lost a dimension the strategy splits, a sum over the per-rank batch instead of a mean,"
                " or code that depends on the rank or the batch size)."
            )
    if not causes and first.quantity == "gradients":
        name = first.worst[0][0] if first.worst else "a parameter"
        causes.append(f"the gradients differ first, at {name!r}, while the loss matched: its backward or reduction.")
    if not causes and first.quantity in ("parameters", "optimizer state"):
        causes.append("losses and gradients matched but the optimizer's update differs (its state or its step).")
    if not causes and first.quantity == "checkpoint":
        causes.append("the checkpoint saved under the strategy does not hold the weights it trained.")
    return causes


def reduced_before(ours: list[dict[str, Any]], ref: list[dict[str, Any]]) -> str | None:
    """Under context parallelism: the first module call that received the same shapes as in one process after
    calls that received the split sequence, which means the step's own code reduced (pooled) the sequence before
    it, each rank over its shard only. ``None`` when the calls show no such place."""
    split = None
    for mine, theirs in zip(ours, ref):
        if mine["name"] != theirs["name"]:
            return None
        if mine["inputs"] != theirs["inputs"]:
            split = split or (mine, theirs)
        elif split is not None and mine["inputs"]:
            return (
                f"{mine['name']} ({mine['class']}) received {_shapes(mine['inputs'])} under the strategy, the same as in"
                f" one process, after {split[0]['name']} had received the split sequence ({_shapes(split[0]['inputs'])}"
                f" here, {_shapes(split[1]['inputs'])} in one process): the sequence dimension was reduced"
                " (pooled) in between, in the step's own code, so each rank reduced only its own shard. Context"
                " parallelism is exact only for per-token outputs and losses: train this model with fsdp2."
            )
    return None


def _shapes(shapes: list[list[int]]) -> str:
    return ", ".join(str(tuple(s)) for s in shapes)


def _loss_matches(rows: list[Row], when: str) -> bool:
    return any(row.quantity == "loss" and row.when == when and row.ok for row in rows)


def rank_reads(model: nn.Module) -> list[str]:
    """``file:line: code`` of every place the model's own classes (not a library's) read the process rank."""
    found: list[str] = []
    seen: set[type] = set()
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls in seen or cls.__module__.split(".")[0] in (*_LIBRARIES, "builtins"):
                continue
            seen.add(cls)
            found += _rank_reads_in(cls)
    return found


def _rank_reads_in(cls: type) -> list[str]:
    try:
        lines, start = inspect.getsourcelines(cls)
        path = inspect.getsourcefile(cls) or "?"
    except (OSError, TypeError):
        return []
    source = textwrap.dedent("".join(lines))
    found = []
    for node in ast.walk(ast.parse(source)):
        attr = node.attr if isinstance(node, ast.Attribute) else None
        call = node.func if isinstance(node, ast.Call) else None
        called = getattr(call, "attr", getattr(call, "id", None))
        if attr in _RANK_ATTRIBUTES or called in _RANK_CALLS:
            line = start + node.lineno - 1
            found.append(f"{Path(path).name}:{line}: {lines[node.lineno - 1].strip()}")
    return list(dict.fromkeys(found))
