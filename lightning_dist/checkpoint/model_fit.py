"""Does a checkpoint fit a model? Key and shape checks with messages that name the key and both shapes."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from torch import Size

from lightning_dist.checkpoint.layout import CheckpointError

_SHOWN = 8


@dataclass
class FitReport:
    """Differences between the model's state and a checkpoint's (keys without the ``state_dict.`` prefix)."""

    missing: list[str] = field(default_factory=list)  # in the model, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)  # in the checkpoint, not in the model
    mismatched: list[tuple[str, Size, Size]] = field(default_factory=list)  # key, model shape, checkpoint shape


def compare_shapes(
    model_shapes: Mapping[str, Size],
    checkpoint_shapes: Mapping[str, Size | None],
    all_model_keys: Collection[str] | None = None,
) -> FitReport:
    """Compare global shapes; a ``None`` checkpoint shape is a non-tensor entry (not compared).

    ``all_model_keys``: the keys of the whole model when this rank holds only part of it (a pipeline stage): a
    checkpoint key is unexpected only if no part holds it.
    """
    report = FitReport()
    for key, shape in model_shapes.items():
        if key not in checkpoint_shapes:
            report.missing.append(key)
        elif checkpoint_shapes[key] is not None and Size(checkpoint_shapes[key]) != Size(shape):
            report.mismatched.append((key, Size(shape), Size(checkpoint_shapes[key])))
    known = model_shapes if all_model_keys is None else all_model_keys
    report.unexpected = [key for key in checkpoint_shapes if key not in known]
    return report


def check_fit(report: FitReport, strict: bool, where: str) -> None:
    """Raise :class:`CheckpointError` for shape mismatches, and for missing/unexpected keys when ``strict``."""
    if report.mismatched:
        lines = [f"  {key}: model {tuple(m)} vs checkpoint {tuple(c)}" for key, m, c in report.mismatched[:_SHOWN]]
        raise CheckpointError(
            f"The checkpoint {where} does not fit the model: {len(report.mismatched)} parameter(s) have another"
            " shape:\n" + "\n".join(lines) + _more(report.mismatched) + "\nWas it saved from a different model"
            " configuration (hidden size, vocabulary, number of layers)?"
        )
    if strict and (report.missing or report.unexpected):
        parts = []
        if report.missing:
            parts.append(f"missing from the checkpoint: {report.missing[:_SHOWN]}{_more(report.missing)}")
        if report.unexpected:
            parts.append(f"not in the model: {report.unexpected[:_SHOWN]}{_more(report.unexpected)}")
        raise CheckpointError(
            f"The checkpoint {where} does not fit the model; keys " + "; keys ".join(parts) + ". To load only the"
            " matching keys, set `strict_loading = False` on your LightningModule (as in Lightning)."
        )


def _more(items: list) -> str:
    return f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
