"""Do the ranks agree? Ranks that share a process group must issue the same collectives on it, in the same order,
with the same sizes; a send must meet a receive of the same size. Where they do not, the job hangs (or reads
garbage) at that collective: the check names the first place, by group, position and rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_dist.dryrun.rank_run import Collective, RankRecord

POINT_TO_POINT = ("send", "recv")


@dataclass(frozen=True)
class Disagreement:
    """On ``group``, at ``position`` (the n-th collective on that group, from 0), ``rank`` issued ``issued`` while
    ``reference_rank`` issued ``expected`` (``None``: nothing more)."""

    group: tuple[int, ...]
    position: int
    rank: int
    issued: Collective | None
    reference_rank: int
    expected: Collective | None
    point_to_point: bool = False

    def describe(self) -> str:
        def text(c: Collective | None) -> str:
            return "nothing" if c is None else f"{c.kind} of {c.bytes} bytes ({c.phase})"

        where = _group_text(self.group, self.point_to_point)
        return (
            f"ranks {self.reference_rank} and {self.rank} disagree on {where} at its collective #{self.position}:"
            f" rank {self.reference_rank} issues {text(self.expected)}, rank {self.rank} issues {text(self.issued)}."
            " On a real run this hangs there (or mixes up the data)."
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "group": list(self.group),
            "position": self.position,
            "rank": self.rank,
            "issued": self.issued.to_json() if self.issued else None,
            "reference_rank": self.reference_rank,
            "expected": self.expected.to_json() if self.expected else None,
            "point_to_point": self.point_to_point,
        }


def disagreements(records: Sequence[RankRecord]) -> list[Disagreement]:
    """For every group two recorded ranks share, and every pair that exchanges point-to-point, the first place they
    differ (ordered by position)."""
    recorded = {r.rank: r for r in records if r.error is None}
    on_group: dict[tuple[int, ...], dict[int, list[Collective]]] = {}
    for record in recorded.values():
        for c in record.collectives:
            if c.kind not in POINT_TO_POINT:
                on_group.setdefault(c.group, {}).setdefault(record.rank, []).append(c)
    found: list[Disagreement] = []
    for group, by_rank in on_group.items():
        members = [rank for rank in group if rank in recorded]
        reference = members[0]
        for rank in members[1:]:
            first = _first_difference(by_rank.get(reference, []), by_rank.get(rank, []))
            if first is not None:
                position, expected, issued = first
                found.append(Disagreement(group, position, rank, issued, reference, expected))
                break
    for sender in recorded.values():
        for receiver in recorded.values():
            sent = [c for c in sender.collectives if c.kind == "send" and c.peer == receiver.rank]
            received = [c for c in receiver.collectives if c.kind == "recv" and c.peer == sender.rank]
            first = _first_difference(sent, received)
            if first is not None:
                position, send, recv = first
                pair = (sender.rank, receiver.rank)
                found.append(Disagreement(pair, position, receiver.rank, recv, sender.rank, send, True))
    return sorted(found, key=lambda d: (d.position, d.group))


def _first_difference(a: list[Collective], b: list[Collective]) -> tuple[int, Any, Any] | None:
    for position in range(max(len(a), len(b))):
        x = a[position] if position < len(a) else None
        y = b[position] if position < len(b) else None
        if x is None or y is None or not _same(x, y):
            return position, x, y
    return None


def _same(a: Collective, b: Collective) -> bool:
    if a.kind in POINT_TO_POINT:  # a send meets a receive of the same size
        return a.bytes == b.bytes
    return (a.kind, a.bytes) == (b.kind, b.bytes)


def _group_text(group: tuple[int, ...], point_to_point: bool) -> str:
    if point_to_point:
        return f"the point-to-point link {group[0]} → {group[1]}"
    ranks = ", ".join(map(str, group)) if len(group) <= 8 else f"{group[0]}, {group[1]}, … {group[-1]}"
    return f"the group of {len(group)} ranks [{ranks}]"
