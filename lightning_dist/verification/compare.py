"""The comparison of a verify check: the strategy's records against the reference's, as rows of a report.

Differences are relative: a tensor's ``max|a − b| / max|b|`` (its largest error against its largest value), a
scalar's ``|a − b| / max(|b|, 1)``. A row passes when its difference is at most the tolerance. Within one quantity
(the gradients of a step, the parameters, one optimizer state), a tensor is judged against at least
:data:`FLOOR` × the largest value of that quantity: a tensor that is zero in exact arithmetic (the gradient of an
attention key's bias, which softmax cancels) holds rounding noise, and noise against noise is no measure.

What is compared, in the order a training step produces it (the first row over the tolerance is the first
difference): per training batch, the samples read (the reference's against the strategy's data-parallel ranks'
together, and peers of one data-parallel rank against each other), the loss and every logged value; per optimizer
step, the learning rates, the gradient norm and every parameter's gradient; after validation, the logged values; at
the end, the parameters, the optimizer states and the checkpoint round trip. Copies of one parameter on several ranks of the strategy's run must
agree with each other too (``replicas``): a gradient that was not reduced shows there.

With an anchored reference (``VerifySettings.anchor``), each of its steps started from the strategy's state, so the
parameters and optimizer states are compared after every step (what each side's step made of the same state),
before the next batch's loss, and not again at the end.

A row whose every element was left out of the judgement (see :func:`noise_driven`) is marked so (``judged`` is
false): it passes, since what it holds is judged elsewhere, but it does not claim a match.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import torch
from torch import Tensor

#: How many of the worst parameters the parameter row names.
WORST = 5
#: A tensor's difference is relative to at least this fraction of the largest value of its quantity.
FLOOR = 1e-3
#: A parameter element whose gradient was, at some step, within this many times its tensor's measured gradient
#: difference between the runs is not judged in the final parameters, whatever the learning rate (see
#: :func:`noise_driven`).
NOISE_MARGIN = 10.0


@dataclasses.dataclass
class Row:
    """One compared quantity. ``when`` is the step or moment, ``worst`` the names that differ most (worst first)."""

    quantity: str
    when: str
    difference: float
    tolerance: float
    worst: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    detail: str = ""
    judged: bool = True

    @property
    def ok(self) -> bool:
        return not self.judged or self.difference <= self.tolerance


def tensor_difference(a: Tensor | None, b: Tensor | None, floor: float = 0.0, skip: Tensor | None = None) -> float:
    """``max|a − b| / max(max|b|, floor)`` (``inf`` when only one exists or the shapes differ); elements where
    ``skip`` is true do not count in the error."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if a.shape != b.shape:
        return math.inf
    a, b = a.double(), b.double()
    scale = max(float(b.abs().max()) if b.numel() else 0.0, floor)
    error = (a - b).abs()
    if skip is not None and skip.shape == error.shape:
        error = error.masked_fill(skip, 0.0)
    error = float(error.max()) if b.numel() else 0.0
    return error / scale if scale > 0 else error


def scalar_difference(a: float | None, b: float | None) -> float:
    """``|a − b| / max(|b|, 1)`` (``inf`` when only one exists)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    if math.isnan(a) and math.isnan(b):
        return 0.0
    return abs(a - b) / max(abs(b), 1.0)


def merge_ranks(records: list[dict[str, Tensor | None]]) -> tuple[dict[str, Tensor | None], list[Row]]:
    """One tensor per name from the ranks' dicts (a pipeline rank holds its stages' names only), and a row per name
    whose copies on different ranks disagree (``replicas``)."""
    merged: dict[str, Tensor | None] = {}
    first_rank: dict[str, int] = {}
    disagreements = []
    for rank, record in enumerate(records):
        for name, tensor in record.items():
            if name not in merged:
                merged[name], first_rank[name] = tensor, rank
                continue
            diff = tensor_difference(tensor, merged[name])
            if diff > 0:
                disagreements.append((name, diff, first_rank[name], rank))
    rows = [
        Row("replicas", "", diff, 0.0, [(name, diff)], f"{name}: rank {r} differs from rank {r0}")
        for name, diff, r0, r in disagreements
    ]
    return merged, rows


def compare_tensors(
    quantity: str,
    when: str,
    ours: dict[str, Tensor | None],
    ref: dict[str, Tensor | None],
    tolerance: float,
    skip: dict[str, Tensor] | None = None,
) -> Row:
    """One row for a dict of tensors: the worst difference, the names that differ most, and names on one side
    only; ``skip`` holds, per name, elements left out of the judgement (said in the row's detail)."""
    floors, skip = _floors(ref), skip or {}
    diffs = {
        name: tensor_difference(ours.get(name), ref.get(name), floors.get(_kind(name), 0.0), skip.get(name))
        for name in sorted(set(ours) | set(ref))
    }
    worst = sorted(diffs.items(), key=lambda item: -item[1])[:WORST]
    only = sorted(set(ours) ^ set(ref))
    notes = [f"only on one side: {', '.join(only[:WORST])}"] if only else []
    skipped = sum(int(mask.sum()) for name, mask in skip.items() if name in diffs)
    elements = sum(t.numel() for t in ref.values() if t is not None)
    if skipped and skipped >= elements and not only:
        # nothing was judged: show the unmasked difference, and say so rather than "ok"
        raw = {name: tensor_difference(ours.get(name), ref.get(name), floors.get(_kind(name), 0.0)) for name in diffs}
        detail = (
            f"none of its {elements} elements judged: the runs' gradients differ by more than the update could show"
            " (judged in the gradients rows)"
        )
        worst = sorted(raw.items(), key=lambda item: -item[1])[:WORST]
        return Row(quantity, when, max(raw.values(), default=0.0), tolerance, worst, detail, judged=False)
    if skipped:
        notes.append(f"{skipped} elements whose gradient was at the runs' rounding level not judged (of {elements})")
    return Row(quantity, when, max(diffs.values(), default=0.0), tolerance, worst, "; ".join(notes))


def noise_driven(
    ours: list[dict[str, Any]],
    ref: list[dict[str, Any]],
    tolerance: float,
    keys: list[tuple[int, int]] | None = None,
    params: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Per parameter, the elements whose final value the runs' rounding decides, so that it cannot be held to
    ``tolerance``. Adam-like optimizers divide each element's gradient by its own running RMS: an element's update is
    about the learning rate whatever its gradient's size, and its error about ``lr × noise / |g|``, where ``noise``
    is the largest difference between the two runs' gradients of its tensor at that step. An element is left out
    where, at some step, that error could exceed ``tolerance`` × its tensor's scale (``|g| ≤ lr · noise / (tolerance ·
    scale)``), or its gradient is within :data:`NOISE_MARGIN` × noise (an attention key's bias, which softmax cancels:
    rounding on both sides). Those elements are judged through their gradients, which a strategy that computes
    gradients wrongly fails. ``keys`` limits the steps looked at (those that led to ``params``, by default the
    reference's final parameters)."""
    params = ref[0]["params"] if params is None else params
    floors = _floors(params)
    masks: dict[str, Tensor] = {}
    wanted = None if keys is None else {tuple(key) for key in keys}
    for step in ref[0]["steps"]:
        key = (step["optimizer"], step["step"])
        if wanted is not None and key not in wanted:
            continue
        mine = [next((s["grads"] for s in r["steps"] if (s["optimizer"], s["step"]) == key), {}) for r in ours]
        grads, _ = merge_ranks(mine)
        lr = max(step["lrs"], default=0.0)
        for name, theirs in step["grads"].items():
            own, param = grads.get(name), params.get(name)
            if theirs is None or own is None or own.shape != theirs.shape:
                continue
            noise = float((own.double() - theirs.double()).abs().max())
            scale = max(float(param.double().abs().max()) if param is not None else 0.0, floors.get("", 0.0))
            bound = max(NOISE_MARGIN * noise, lr * noise / (tolerance * scale) if scale > 0 else 0.0)
            near = theirs.double().abs() <= bound
            masks[name] = masks[name] | near if name in masks else near
    return {name: mask for name, mask in masks.items() if bool(mask.any())}


def _kind(name: str) -> str:
    """The part of a flattened name that says which quantity it is (an optimizer state's key: ``exp_avg``)."""
    return name.rpartition(" ")[2] if " " in name else ""


def _floors(ref: dict[str, Tensor | None]) -> dict[str, float]:
    """:data:`FLOOR` × the largest value of each kind of tensor in ``ref``."""
    largest: dict[str, float] = {}
    for name, tensor in ref.items():
        if tensor is not None and tensor.numel():
            kind = _kind(name)
            largest[kind] = max(largest.get(kind, 0.0), float(tensor.double().abs().max()))
    return {kind: FLOOR * value for kind, value in largest.items()}


def gradient_norm(grads: dict[str, Tensor | None]) -> float:
    """The global 2-norm of the gradients."""
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values() if g is not None))


def compare_runs(ours: list[dict[str, Any]], ref: list[dict[str, Any]], tolerance: float) -> list[Row]:
    """Every row of the report, in the order a run produces the quantities (see the module docstring)."""
    rows: list[Row] = []
    ref_losses, our_losses = ref[0]["losses"], ours[0]["losses"]
    logged = {entry["when"]: entry["values"] for entry in ref[0]["logged"]}
    our_logged = {entry["when"]: entry["values"] for entry in ours[0]["logged"]}
    steps = _steps_by_batch(ours[0], ref[0])
    after = {entry["moment"]: entry for entry in ref[0].get("after", [])}
    for when in dict.fromkeys([*logged, *our_logged, *after]):
        if when in after:
            rows += _after_step_rows(when, after[when], ours, ref, tolerance)
        if when.startswith("train batch "):
            index = int(when.rsplit(" ", 1)[1])
            rows += sample_rows(when, index, ours, ref)
            mine, theirs = _at(our_losses, index), _at(ref_losses, index)
            if mine is not None or theirs is not None:  # manual optimization may return no loss
                rows.append(Row("loss", when, scalar_difference(mine, theirs), tolerance))
        rows += _logged_rows(when, our_logged.get(when, {}), logged.get(when, {}), tolerance)
        for key in steps.get(when, []):
            rows += _step_rows(key, ours, ref, tolerance)
    if after:  # anchored: compared after each step above
        return rows
    params, replica_rows = merge_ranks([r["params"] for r in ours])
    rows += replica_rows
    skip = noise_driven(ours, ref, tolerance)
    rows.append(compare_tensors("parameters", "end", params, ref[0]["params"], tolerance, skip))
    for index, (mine, theirs) in enumerate(zip(ours[0]["optimizers"], ref[0]["optimizers"])):
        merged = _merge_optimizer([r["optimizers"][index] for r in ours])
        rows.append(_compare_optimizer(index, merged, theirs, tolerance))
    return rows


def sample_rows(when: str, index: int, ours: list[dict[str, Any]], ref: list[dict[str, Any]]) -> list[Row]:
    """The samples of training batch ``index``: peers of one data-parallel rank of the strategy must read the same
    (``sample replicas``), and the strategy's data-parallel ranks together the reference's (``samples``; a
    multiset, since each rank reads its own part in its own order). No row where a batch had no per-sample
    rows to fingerprint (see :func:`~lightning_dist.verification.data.sample_fingerprints`)."""
    groups: dict[int, list[tuple[int, list[str]]]] = {}
    for rank, record in enumerate(ours):
        prints = _at(record.get("samples", []), index)
        if prints is None:
            return []
        groups.setdefault(record["meta"].get("data_parallel_rank", rank), []).append((rank, prints))
    theirs = [_at(record.get("samples", []), index) for record in ref]
    if not groups or any(prints is None for prints in theirs):
        return []
    rows = []
    for dp_rank, peers in groups.items():
        first_rank, first = peers[0]
        for rank, prints in peers[1:]:
            if Counter(prints) != Counter(first):
                detail = (
                    f"ranks {first_rank} and {rank} share data-parallel rank {dp_rank} (tensor, context or pipeline"
                    " peers) but read different samples"
                )
                rows.append(Row("sample replicas", when, _unshared(prints, first), 0.0, [], detail))
    strategy = Counter(p for peers in groups.values() for p in peers[0][1])
    reference = Counter(p for prints in theirs for p in prints)
    detail = (
        f"the strategy's {len(groups)} data-parallel ranks read {sum(strategy.values())} samples together, the"
        f" reference {sum(reference.values())}; {sum((strategy & reference).values())} in common"
    )
    firsts = [Counter(peers[0][1]) for peers in groups.values()]
    if len(firsts) > 1 and all(counts == firsts[0] for counts in firsts):
        detail += (
            "; every data-parallel rank read the same samples: the loader does not split the data over them"
            " (use_distributed_sampler=False, and no sampler built from trainer.strategy.distributed_sampler_kwargs)"
        )
    rows.append(Row("samples", when, _unshared(list(strategy.elements()), list(reference.elements())), 0.0, [], detail))
    return rows


def _unshared(a: list[str], b: list[str]) -> float:
    """The fraction of samples not in common between two multisets (0: the same samples)."""
    common = sum((Counter(a) & Counter(b)).values())
    return 1.0 - common / max(len(a), len(b), 1)


def _after_step_rows(
    moment: str, entry: dict[str, Any], ours: list[dict[str, Any]], ref: list[dict[str, Any]], tolerance: float
) -> list[Row]:
    """An anchored reference's state at ``moment`` (what its last steps made of the strategy's state before them)
    against the strategy's own state there: parameters (with their copies on several ranks), optimizer states."""
    when = "after " + ", ".join(_step_name(tuple(key), ref) for key in entry["steps"][-1:])
    if moment == "end of training":
        states = [{"params": r["params"], "optimizers": r["optimizers"]} for r in ours]
    else:
        states = [r["anchors"][moment] for r in ours if moment in r.get("anchors", {})]
    if not states:
        return [Row("parameters", when, math.inf, tolerance, [], "the strategy's run kept no state here")]
    params, rows = merge_ranks([state["params"] for state in states])
    for row in rows:
        row.when = when
    skip = noise_driven(ours, ref, tolerance, entry["steps"], entry["params"])
    rows.append(compare_tensors("parameters", when, params, entry["params"], tolerance, skip))
    for index, theirs in enumerate(entry["optimizers"]):
        merged = _merge_optimizer([state["optimizers"][index] for state in states if index < len(state["optimizers"])])
        row = _compare_optimizer(index, merged, theirs, tolerance)
        row.when = when if len(entry["optimizers"]) == 1 else f"{when} (optimizer {index})"
        rows.append(row)
    return rows


def _step_name(key: tuple[int, int], ref: list[dict[str, Any]]) -> str:
    """``step 2``, or with several optimizers ``optimizer 1 step 2``."""
    optimizer, step = key
    return (
        f"optimizer {optimizer} step {step}" if len({s["optimizer"] for s in ref[0]["steps"]}) > 1 else f"step {step}"
    )


def _at(values: list[Any], index: int) -> Any:
    return values[index] if index < len(values) else None


def _steps_by_batch(ours: dict[str, Any], ref: dict[str, Any]) -> dict[str, list[tuple[int, int]]]:
    """The optimizer steps (optimizer, step) taken in each training batch, by its logged moment."""
    placed: dict[str, list[tuple[int, int]]] = {}
    for record in (ref, ours):
        for step in record["steps"]:
            keys = placed.setdefault(f"train batch {step['batch']}", [])
            if (step["optimizer"], step["step"]) not in keys:
                keys.append((step["optimizer"], step["step"]))
    return placed


def _logged_rows(when: str, ours: dict[str, float], ref: dict[str, float], tolerance: float) -> list[Row]:
    rows = []
    for name in sorted(set(ours) | set(ref)):
        detail = "" if name in ours and name in ref else ("not logged by the reference" if name in ours else
                                                          "not logged under the strategy")  # fmt: skip
        rows.append(
            Row(f"logged {name}", when, scalar_difference(ours.get(name), ref.get(name)), tolerance, [], detail)
        )
    return rows


def _step_rows(
    key: tuple[int, int], ours: list[dict[str, Any]], ref: list[dict[str, Any]], tolerance: float
) -> list[Row]:
    when = _step_name(key, ref)
    ref_step = next((s for s in ref[0]["steps"] if (s["optimizer"], s["step"]) == key), None)
    our_steps = [next((s for s in r["steps"] if (s["optimizer"], s["step"]) == key), None) for r in ours]
    if ref_step is None or any(s is None for s in our_steps):
        side = "the reference" if ref_step is None else "the strategy's run"
        return [Row("optimizer step", when, math.inf, tolerance, [], f"{side} did not take this step")]
    lr = max(scalar_difference(a, b) for a, b in zip(our_steps[0]["lrs"], ref_step["lrs"]))
    grads, replica_rows = merge_ranks([s["grads"] for s in our_steps])
    for row in replica_rows:
        row.quantity, row.when = "gradient replicas", when
    norm = scalar_difference(gradient_norm(grads), gradient_norm(ref_step["grads"]))
    return [
        Row("learning rate", when, lr, tolerance),
        *replica_rows,
        Row("gradient norm", when, norm, tolerance),
        compare_tensors("gradients", when, grads, ref_step["grads"], tolerance),
    ]


def _merge_optimizer(ranks: list[dict[str, dict[str, Any]]]) -> dict[str, Tensor | None]:
    flat: list[dict[str, Tensor | None]] = []
    for record in ranks:
        flat.append({f"{name} {key}": _as_tensor(v) for name, state in record.items() for key, v in state.items()})
    return merge_ranks(flat)[0]


def _compare_optimizer(
    index: int, ours: dict[str, Tensor | None], ref: dict[str, dict[str, Any]], tolerance: float
) -> Row:
    flat = {f"{name} {key}": _as_tensor(v) for name, state in ref.items() for key, v in state.items()}
    row = compare_tensors("optimizer state", "end", ours, flat, tolerance)
    row.when = f"end (optimizer {index})"
    return row


def _as_tensor(value: Any) -> Tensor:
    return value if isinstance(value, Tensor) else torch.tensor(float(value), dtype=torch.float64)
