"""``lightning-dist inspect CKPT``: step, how it was saved, whether its files are intact, and every tensor's key,
shape, dtype and size. A damaged checkpoint prints what is wrong and exits with status 2."""

from __future__ import annotations

import argparse
import json

from lightning_dist.checkpoint.summary import format_summary, summarize_checkpoint
from lightning_dist.commands import add_trust_code_argument


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-dist inspect",
        description="Summarize a checkpoint (sharded folder or single file) without loading a model.",
    )
    parser.add_argument("checkpoint")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--all", action="store_true", help="list every tensor (default: the first 50)")
    parser.add_argument(
        "--no-checksums",
        action="store_true",
        help="check only that every file is there with its size (skip reading every byte to verify checksums)",
    )
    add_trust_code_argument(parser)
    args = parser.parse_args(argv)
    summary = summarize_checkpoint(args.checkpoint, checksums=not args.no_checksums, weights_only=not args.trust_code)
    if args.json:
        print(json.dumps(summary.as_dict(), indent=2))
    else:
        print(format_summary(summary, max_rows=None if args.all else 50))
