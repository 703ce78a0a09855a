"""``lightning-dist consolidate CKPT OUT``: one file from a sharded checkpoint, in one process, without a GPU."""

from __future__ import annotations

import argparse

from lightning_dist.checkpoint.consolidate import load_full_checkpoint, save_safetensors, save_torch, weights_only
from lightning_dist.checkpoint.export_target import check_export_target
from lightning_dist.commands import add_quiet_argument, add_trust_code_argument


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-dist consolidate",
        description="Merge a sharded (DCP) checkpoint folder into one file. The torch output is a plain Lightning"
        " checkpoint: MyModule.load_from_checkpoint(OUT) works, and a one-device Trainer resumes from it.",
    )
    parser.add_argument("checkpoint", help="sharded checkpoint folder (or a single-file checkpoint)")
    parser.add_argument(
        "out",
        help="output file: a new path, or an earlier export of lightning_dist (never a training checkpoint or the input)",
    )
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="keep only the model weights and hyperparameters (no optimizer, loop or callback state)",
    )
    parser.add_argument(
        "--format",
        choices=("torch", "safetensors"),
        default=None,
        help="output format (default: safetensors if OUT ends with .safetensors, else torch); safetensors holds"
        " the weights only",
    )
    add_trust_code_argument(parser)
    add_quiet_argument(parser)
    args = parser.parse_args(argv)
    fmt = args.format or ("safetensors" if args.out.endswith(".safetensors") else "torch")
    check_export_target(args.out, args.checkpoint, command="consolidate")  # before the (long) read
    checkpoint = load_full_checkpoint(args.checkpoint, weights_only=not args.trust_code)
    if fmt == "safetensors":
        out = save_safetensors(checkpoint, args.out, source=args.checkpoint)
    else:
        state = weights_only(checkpoint) if args.weights_only else checkpoint
        out = save_torch(state, args.out, args.checkpoint, progress=not args.quiet)
    if args.quiet:
        return
    tensors = len(checkpoint["state_dict"])
    print(
        f"wrote {out} ({fmt}, {tensors} model tensors{', weights only' if args.weights_only or fmt != 'torch' else ''})"
    )
