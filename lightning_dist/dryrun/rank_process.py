"""A dry-run rank in a process of its own: ``python -m lightning_dist.dryrun.rank_process '<json>'``.

Each rank gets a fresh process: torch keeps state across process groups (DTensor's sharding caches hold device meshes,
which compare equal between ranks of one world but name the groups of the rank that made them), so a second rank in
the same process could run on the first one's groups. The record comes back on stdout, after :data:`MARK`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lightning_dist.dryrun.rank_run import RankRecord, run_rank

MARK = "lightning-dist-dryrun-record:"


def main(argv: list[str]) -> None:
    task = json.loads(argv[0])
    try:
        mailbox = Path(task["mailbox"]) if task.get("mailbox") else None
        record = run_rank(task["cli_args"], task["rank"], task["role"], task["world_size"], task["num_nodes"], mailbox,
                          task.get("peers", ()))  # fmt: skip
    except Exception as error:  # noqa: BLE001 (reported for this rank: its message)
        record = RankRecord(task["rank"], task["role"], error=f"{type(error).__name__}: {error}")
    print(MARK + json.dumps(record.to_json()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
