"""The result of a verify check: passed or not, the first difference and its likely cause, and a table of what was
compared (printed by ``lightning-dist verify``; ``--json`` writes :meth:`VerifyReport.to_json`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lightning_dist.verification.compare import Row


@dataclasses.dataclass
class VerifyReport:
    """What ``lightning-dist verify`` found. ``bool(report)`` is whether the strategy's run matched the reference.

    Attributes:
        strategy: The strategy checked, with its mesh as it ran.
        against: The reference it was checked against.
        tolerance: The largest relative difference accepted, and why that one (``tolerance_reason``).
        rows: Every compared quantity (see :mod:`lightning_dist.verification.compare`).
        failure: Why there is nothing to compare: a run refused or failed (its error), else empty.
        causes: Likely causes of the first difference, where the package can tell.
        notes: What verify changed or could not compare (dropout zeroed, what quantized communication allows).
        seconds: Wall-clock time of the whole check; ``run_seconds`` of each run (``candidate``, ``reference``).
    """

    strategy: str
    against: str
    tolerance: float
    tolerance_reason: str
    steps: int
    rows: list[Row] = dataclasses.field(default_factory=list)
    failure: str = ""
    causes: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    run_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    workdir: str = ""

    @property
    def passed(self) -> bool:
        return not self.failure and all(row.ok for row in self.rows)

    def __bool__(self) -> bool:
        return self.passed

    @property
    def first_difference(self) -> Row | None:
        """The first compared quantity over the tolerance, in the order a training run produces them."""
        return next((row for row in self.rows if not row.ok), None)

    def summary(self) -> str:
        """One line: equivalent, or what differs first."""
        if self.failure:
            return f"NOT VERIFIED: {self.failure}"
        row = self.first_difference
        if row is None:
            worst = max((r.difference for r in self.rows if math.isfinite(r.tolerance) and r.judged), default=0.0)
            return (
                f"EQUIVALENT: {self.strategy} matches {self.against} over {self.steps} steps"
                f" (largest relative difference {worst:.1e}, tolerance {self.tolerance:.0e})."
            )
        names = f" ({', '.join(name for name, _ in row.worst[:3])})" if row.worst else ""
        return (
            f"DIFFERENT: first at {row.when or 'the end'}: {row.quantity}{names} differs by {_number(row.difference)}"
            f" (tolerance {self.tolerance:.0e})."
        )

    def table(self) -> str:
        """The report as text: a header, the compared rows (one per quantity and moment), the worst parameters,
        the likely causes and the notes."""
        lines = [
            f"lightning-dist verify: {self.strategy} against {self.against}, {self.steps} steps",
            f"tolerance {self.tolerance:.0e} ({self.tolerance_reason}); relative differences, max|a-b|/max|b|",
            "",
        ]
        if self.rows:
            width = max(28, *(len(row.when) for row in self.rows))
            lines.append(f"{'when':<{width}} {'quantity':<34} {'difference':>11}  ")
            for row in self.rows:
                lines.append(f"{row.when:<{width}} {row.quantity[:34]:<34} {_number(row.difference):>11}  {_mark(row)}")
                if (not row.ok or not row.judged) and row.detail:
                    lines.append(f"{'':<{width}}   {row.detail}")
            parameters = next((r for r in reversed(self.rows) if r.quantity == "parameters"), None)
            if parameters is not None and parameters.worst:
                lines += ["", f"parameters that differ most {parameters.when or 'at the end'}:"]
                lines += [f"  {name:<60} {_number(diff)}" for name, diff in parameters.worst]
        lines += ["", self.summary()]
        lines += [f"likely cause: {cause}" for cause in self.causes]
        lines += [f"note: {note}" for note in self.notes]
        runs = ", ".join(f"{role} {seconds:.0f} s" for role, seconds in self.run_seconds.items())
        lines.append(f"time: {self.seconds:.0f} s ({runs})" if runs else f"time: {self.seconds:.0f} s")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as plain data (infinite differences as the string ``"inf"``)."""
        first = self.first_difference
        return {
            "passed": self.passed,
            "summary": self.summary(),
            "strategy": self.strategy,
            "against": self.against,
            "steps": self.steps,
            "tolerance": self.tolerance,
            "tolerance_reason": self.tolerance_reason,
            "failure": self.failure,
            "first_difference": None if first is None else _row_json(first),
            "causes": self.causes,
            "notes": self.notes,
            "seconds": round(self.seconds, 1),
            "run_seconds": {role: round(seconds, 1) for role, seconds in self.run_seconds.items()},
            "rows": [_row_json(row) for row in self.rows],
        }


def _row_json(row: Row) -> dict[str, Any]:
    return {
        "quantity": row.quantity,
        "when": row.when,
        "difference": _finite(row.difference),
        "ok": row.ok,
        "judged": row.judged,
        "worst": [[name, _finite(diff)] for name, diff in row.worst],
        "detail": row.detail,
    }


def _mark(row: Row) -> str:
    """``ok``, ``DIFFERS``, ``shown`` (compared, not judged: a stated tolerance does not cover it) or ``not judged``
    (every element left out: judged through other rows)."""
    if not row.judged:
        return "not judged"
    return "shown" if math.isinf(row.tolerance) else "ok" if row.ok else "DIFFERS"


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else "inf"


def _number(value: float) -> str:
    return "missing" if math.isinf(value) else f"{value:.2e}"
