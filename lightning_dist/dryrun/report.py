"""A dry run's result: every recorded rank, the agreement check, the memory check, as a table and as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_dist.dryrun.agreement import Disagreement
from lightning_dist.dryrun.rank_run import RankRecord
from lightning_dist.parallel.mesh import ParallelDims

GIB = 1024**3


@dataclass
class DryRunReport:
    world_size: int
    num_nodes: int
    mesh: str
    ranks: list[RankRecord]
    disagreements: list[Disagreement] = field(default_factory=list)
    device_memory: int | None = None
    seconds: float = 0.0
    dims: ParallelDims | None = None
    planned: str | None = None  # mesh="auto": what the planner chose

    @property
    def agree(self) -> bool:
        return not self.disagreements

    @property
    def failed(self) -> list[RankRecord]:
        return [r for r in self.ranks if r.error is not None]

    @property
    def over_memory(self) -> list[RankRecord]:
        if self.device_memory is None:
            return []
        return [r for r in self.ranks if r.error is None and max(r.peak_bytes, r.later_step_bytes) > self.device_memory]

    @property
    def passed(self) -> bool:
        return self.agree and not self.failed and not self.over_memory

    def to_json(self) -> dict[str, Any]:
        groups: dict[tuple[int, ...], int] = {}

        def group_id(group: tuple[int, ...]) -> int:
            return groups.setdefault(group, len(groups))

        ranks = []
        for r in self.ranks:
            collectives = []
            for c in r.collectives:
                entry = c.to_json()
                entry["group"] = group_id(c.group)
                collectives.append(entry)
            ranks.append({"rank": r.rank, "role": r.role, "peak_bytes": r.peak_bytes,
                          "memory": {k: v for k, v in r.memory.items() if k != "total"},
                          "later_step_bytes": r.later_step_bytes,
                          "later_step": {k: v for k, v in r.later_step.items() if k != "total"},
                          "collectives": collectives, "seconds": round(r.seconds, 3), "error": r.error})  # fmt: skip
        first = self.disagreements[0].to_json() if self.disagreements else None
        return {
            "world_size": self.world_size,
            "num_nodes": self.num_nodes,
            "mesh": self.mesh,
            "device_memory": self.device_memory,
            "ranks": ranks,
            "groups": {str(i): list(g) for g, i in groups.items()},
            "agree": self.agree,
            "first_disagreement": first,
            "passed": self.passed,
            "seconds": round(self.seconds, 3),
        }

    def table(self) -> str:
        head = (f"dry run: {self.world_size} ranks ({self.num_nodes} node(s)), mesh {self.mesh};"
                f" {len(self.ranks)} ranks run in {self.seconds:.1f} s")  # fmt: skip
        columns = (f"{'rank':>6}  {'role':<28} {'peak GiB':>9} {'params':>8} {'grads':>8} {'optim':>8}"
                   f" {'activ.':>8} {'later':>8} {'colls':>6}")  # fmt: skip
        lines = [head, *([self.planned] if self.planned else []), "", columns]
        first_with: dict[str, int] = {}  # an error's text → the first rank that failed with it
        for r in self.ranks:
            if r.error is not None:
                same = first_with.setdefault(r.error, r.rank)
                told = r.error if same == r.rank else f"as rank {same}"
                lines.append(f"{r.rank:>6}  {r.role:<28} failed: {told}")
                continue
            m = r.memory
            lines.append(
                f"{r.rank:>6}  {r.role:<28} {r.peak_bytes / GIB:>9.3f} {m.get('parameters', 0) / GIB:>8.3f}"
                f" {m.get('gradients', 0) / GIB:>8.3f} {m.get('optimizer', 0) / GIB:>8.3f}"
                f" {m.get('activations', 0) / GIB:>8.3f} {r.later_step_bytes / GIB:>8.3f} {len(r.collectives):>6}"
            )
        lines.append("")
        ran = len(self.ranks) - len(self.failed)
        if self.failed:
            causes = "; ".join(f"{sum(r.error == e for r in self.failed)} with rank {k}'s error" for e, k in first_with.items())
            lines.append(f"failed: {len(self.failed)} of the {len(self.ranks)} ranks run ({causes})")
        if not ran:
            lines.append("no rank finished its step: nothing is known of memory or collectives")
            return "\n".join(lines)
        some = "" if not self.failed else f" that finished ({ran} of {len(self.ranks)})"
        lines.append(
            "peak: the step run (by category); later: a later step's peak, with the optimizer states (projected)"
        )
        if self.device_memory is not None:
            over = self.over_memory
            lines.append(
                f"memory: every rank{some} within {self.device_memory / GIB:.1f} GiB"
                if not over
                else f"memory: {len(over)} rank(s) over {self.device_memory / GIB:.1f} GiB: "
                + ", ".join(
                    f"rank {r.rank} ({r.role}) needs {max(r.peak_bytes, r.later_step_bytes) / GIB:.2f} GiB"
                    for r in over
                )
            )
        if self.agree:
            lines.append(f"collectives: the ranks{some} agree on every group they share")
        else:
            lines.append(f"collectives: {len(self.disagreements)} disagreement(s); the first: "
                         + self.disagreements[0].describe())  # fmt: skip
        return "\n".join(lines)
