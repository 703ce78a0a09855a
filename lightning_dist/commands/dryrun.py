"""``lightning-dist dryrun``: rehearse a run of any size on this machine, before the queue and the hour of a cluster.
Takes what ``lightning-dist fit`` takes, plus the size of the real run::

    lightning-dist dryrun --config cfg.yaml --world-size 1024 --num-nodes 128 --device-memory 80GiB --json dry.json

Each role of the mesh runs the strategy's real setup and a training step on torch's fake process group and fake
tensors (the memory reported is a later step's, with the optimizer's states): its peak memory by category and every collective
it issues are recorded, and ranks that share a group must issue the same collectives. Exit status: 0 when they agree and each fits ``--device-memory``, 1
when not (or a rank failed), 2 when the configuration cannot be dry-run. See docs/dryrun.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from lightning_dist.commands.errors import CommandError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}  # fmt: skip


def memory_size(text: str) -> int:
    """``80GiB``, ``80GB``, ``8e10``: bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size (write 80GiB, 80GB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-dist dryrun", description=__doc__.split("\n\n")[0],
                                epilog="Every other argument is `lightning-dist fit`'s (--config, --model.*, ...)."
                                " See docs/dryrun.md.", allow_abbrev=False)  # fmt: skip
    p.add_argument("--world-size", type=int, required=True, help="ranks of the real run (devices × num_nodes)")
    p.add_argument("--num-nodes", type=int, default=1, help="nodes of the real run (default 1)")
    p.add_argument("--ranks", type=int, nargs="+", default=[], help="ranks to run besides one of every role")
    p.add_argument("--all-ranks", action="store_true", help="run every rank (small worlds)")
    p.add_argument("--device-memory", type=memory_size, help="memory of one device (80GiB): a rank above fails")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors (the exit status and --json tell)")
    return p


def main(argv: list[str]) -> None:
    """Run ``lightning-dist dryrun`` with ``argv``; exits with its status."""
    from lightning_dist.dryrun import DryRunError, dry_run

    args, fit_args = parser().parse_known_args(argv)
    try:
        report = dry_run(fit_args, args.world_size, args.num_nodes, args.ranks, args.device_memory, args.all_ranks,
                         progress=not args.quiet)  # fmt: skip
    except DryRunError as error:
        raise CommandError(str(error)) from None
    if not args.quiet:
        print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
    sys.exit(0 if report.passed else 1)
