"""``lightning-dist export CKPT OUT --format hf|peft|litgpt``: a Hugging Face model folder (LoRA adapters merged), a
PEFT adapter folder or a litgpt folder from any of our checkpoints, in one process, without a GPU, one shard in memory
at a time."""

from __future__ import annotations

import argparse

from lightning_dist.checkpoint.export import FORMATS, export_checkpoint
from lightning_dist.checkpoint.export.dtype import DTYPES
from lightning_dist.commands import add_quiet_argument, add_trust_code_argument


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-dist export",
        description="Write the model of a checkpoint (a sharded folder or a single file) as a folder that"
        " transformers' from_pretrained (--format hf; a LoRA model's adapters merged), PEFT's"
        " PeftModel.from_pretrained (--format peft: the adapter alone) or litgpt's GPT (--format litgpt) loads.",
    )
    parser.add_argument("checkpoint", help="sharded checkpoint folder or single-file checkpoint")
    parser.add_argument(
        "out", help="output folder: a new path, or an earlier export of lightning_dist (never anything else)"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        required=True,
        help="hf: Hugging Face model folder (LoRA merged); peft: LoRA adapter folder; litgpt: litgpt folder",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="write every floating-point tensor in this dtype (default: as trained; bfloat16 halves a model trained"
        " in float32)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="folder to copy the tokenizer files and generation config from (hf, peft; default: the initial_weights"
        " folder the checkpoint records)",
    )
    parser.add_argument(
        "--base-model",
        default=None,
        help="the base model adapter_config.json names (peft; default: the initial_weights folder the checkpoint"
        " records)",
    )
    parser.add_argument(
        "--stacked-experts",
        action="store_true",
        help="hf: keep a mixture-of-experts model's experts stacked as transformers 5 holds them (default: one tensor"
        " per expert, the layout of published checkpoints)",
    )
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
    add_quiet_argument(parser)
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
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        base_model=args.base_model,
        stacked_experts=args.stacked_experts,
        progress=not args.quiet,
    )
    if args.quiet:
        return
    for line in report.tidied:
        print(line)
    merged = f"; {report.merged} LoRA layers merged" if report.merged else ""
    print(
        f"wrote {report.out} ({report.format}: {report.tensors} tensors, {report.total_bytes / 2**20:.1f} MiB in"
        f" {', '.join(report.files)}; model prefix {report.prefix!r}{merged}; at most"
        f" {report.peak_tensor_bytes / 2**20:.1f} MiB of tensors held at once)"
    )
    if report.tokenizer:
        print(report.tokenizer)
