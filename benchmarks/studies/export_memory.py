"""What ``lightning-dist export --format hf`` holds in memory: the growth of the exporting process's peak resident
memory over its resident memory after the imports (Linux: the peak, ``VmHWM``, is reset just before the export), against the model's size and the shard size, for a
sharded (DCP) checkpoint and a single-file one of a stock Llama. Each export runs in a fresh process.

    python -m benchmarks.export_memory                       # a 0.8 GB (fp32) Llama, 50 MB shards
    python -m benchmarks.export_memory --layers 2 --shard-size 20MB

The figure is in docs/export.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from lightning_dist import DistributedCheckpointIO, FullStateCheckpointIO
from lightning_dist.checkpoint.export.model_configs import PRETRAINED_CONFIGS_KEY, pretrained_configs
from lightning_dist.checkpoint.layout import PROVENANCE_KEY


def _checkpoint(layers: int, vocab: int) -> tuple[dict, int]:
    """A checkpoint dict of a LightningModule holding a stock Llama as ``self.model``, and the model's bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8)  # fmt: skip
    holder = torch.nn.Module()
    holder.model = LlamaForCausalLM(config)
    state = holder.state_dict()
    provenance = {PRETRAINED_CONFIGS_KEY: pretrained_configs(holder)}
    return {"state_dict": state, "global_step": 1, PROVENANCE_KEY: provenance}, sum(t.nbytes for t in state.values())


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def _child(checkpoint: str, out: str, shard_size: str) -> None:
    """Export in this process; print its resident memory before and its peak after (KiB)."""
    import transformers  # noqa: F401  (imported before the baseline, as the export needs it)

    from lightning_dist.checkpoint.export import export_checkpoint

    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the resident memory now
    before = _status_kib("VmRSS")
    report = export_checkpoint(checkpoint, out, max_shard_size=shard_size)
    after = _status_kib("VmHWM")
    shards = sum(f.endswith(".safetensors") for f in report.files)
    print(json.dumps({"before_kib": before, "after_kib": after, "shards": shards,
                      "peak_tensor_bytes": report.peak_tensor_bytes, "total_bytes": report.total_bytes}))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.export_memory", description=__doc__)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--shard-size", default="50MB")
    parser.add_argument("--child", nargs=2, metavar=("CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child, args.shard_size)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, model_bytes = _checkpoint(args.layers, args.vocab)
        DistributedCheckpointIO().save_checkpoint(checkpoint, Path(tmp) / "sharded")
        FullStateCheckpointIO().save_checkpoint(checkpoint, Path(tmp) / "single.ckpt")
        del checkpoint
        print(f"model: {model_bytes / 2**20:.0f} MiB (fp32), shards of at most {args.shard_size}")
        for name in ("sharded", "single.ckpt"):
            command = [sys.executable, "-m", "benchmarks.export_memory", "--shard-size", args.shard_size,
                       "--child", str(Path(tmp) / name), str(Path(tmp) / f"out-{name}")]  # fmt: skip
            result = json.loads(
                subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
            growth = (result["after_kib"] - result["before_kib"]) / 1024
            print(
                f"{name:12s} {result['shards']} shards; peak RSS growth {growth:.0f} MiB"
                f" ({growth * 2**20 / model_bytes:.2f} of the model);"
                f" most tensor bytes held at once {result['peak_tensor_bytes'] / 2**20:.0f} MiB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
