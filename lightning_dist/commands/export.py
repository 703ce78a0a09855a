"""``lightning-dist export CKPT OUT --format hf|litgpt``: a Hugging Face or litgpt model folder from any of our
checkpoints, in one process, without a GPU, one shard in memory at a time."""

from __future__ import annotations

import argparse

from lightning_dist.checkpoint.export import FORMATS, export_checkpoint
from lightning_dist.commands import add_trust_code_argument


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-dist export",
        description="Write the model of a checkpoint (a sharded folder or a single file) as a folder that"
        " transformers' from_pretrained (--format hf) or litgpt's GPT (--format litgpt) loads.",
    )
    parser.add_argument("checkpoint", help="sharded checkpoint folder or single-file checkpoint")
    parser.add_argument(
        "out", help="output folder: a new path, or an earlier export of lightning_dist (never anything else)"
    )
    parser.add_argument("--format", choices=FORMATS, required=True, help="hf: Hugging Face folder; litgpt")
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file of an hf export, in bytes or as '5GB', '500MB', '2GiB' (default: 5GB)",
    )
    parser.add_argument(
        "--prefix",
        default=None,
        help="the LightningModule attribute path of the model, with its dot ('model.', 'net.model.'); default: the"
        " one recorded in the checkpoint, or found from the names",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="the model's config (config.json for hf, model_config.yaml for litgpt, or a folder holding it), for a"
        " checkpoint saved without one",
    )
    add_trust_code_argument(parser)
    args = parser.parse_args(argv)
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    report = export_checkpoint(
        args.checkpoint,
        args.out,
        format=args.format,
        max_shard_size=size,
        prefix=args.prefix,
        config=args.config,
        weights_only=not args.trust_code,
    )
    print(
        f"wrote {report.out} ({report.format}: {report.tensors} tensors, {report.total_bytes / 2**20:.1f} MiB in"
        f" {', '.join(report.files)}; model prefix {report.prefix!r}; at most"
        f" {report.peak_tensor_bytes / 2**20:.1f} MiB of tensors held at once)"
    )
