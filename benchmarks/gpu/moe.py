"""Mixture-of-experts on several GPUs: plain ``fsdp2`` (every rank all-gathers every expert) against
``expert_parallel`` (each rank keeps ``E / ep`` experts, tokens travel by all-to-all), on a stock
``MixtralForCausalLM`` built from a config (random weights), bf16-mixed, random token ids.

    python -m benchmarks.gpu_moe                       # every GPU of the machine (at least 2), size "small"
    python -m benchmarks.gpu_moe --devices 4 --sizes tiny,small
    python -m benchmarks.gpu_moe --accelerator cpu --devices 2 --sizes toy --warmup 1 --steps 2   # a CPU smoke run

Each setup runs in a fresh set of processes (``Trainer(devices=N)``), one after the other. Step time is the median
of ``steps`` timed steps after ``warmup`` untimed ones; tokens/s counts every rank's tokens; peak memory is rank 0's
``torch.cuda.max_memory_allocated``; the bytes of one step (all-gather, all-to-all, reduce-scatter) are rank 0's,
counted by :class:`lightning_dist.profiling.CommCounter`. The table gives ``expert_parallel`` / ``fsdp2`` for
tokens/s and all-gather bytes. Results go to ``benchmarks/results/gpu/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.common.launch import run_command
from benchmarks.gpu.throughput import ConfigShape, StepTimer

SETUPS: dict[str, str] = {
    "fsdp2": "lightning_dist fsdp2 (experts FSDP-sharded, all-gathered each step)",
    "expert_parallel": "lightning_dist expert_parallel (ep = all ranks, tokens by all-to-all)",
    "expert_parallel_overlap": "the same, tokens in 2 chunks whose all-to-alls overlap the experts (expert_dispatch_chunks=2)",
}
REFERENCE = "fsdp2"


@dataclass(frozen=True)
class MixtralSize(ConfigShape):
    """A ``transformers.MixtralConfig`` shape and the batch per rank it is run with."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int = 2
    vocab_size: int = 32000
    batch_size: int = 4


SIZES: dict[str, MixtralSize] = {
    "toy": MixtralSize("toy", 64, 2, 4, 2, 96, 4, vocab_size=256, batch_size=2),  # CPU smoke runs
    "tiny": MixtralSize("tiny", 512, 4, 8, 4, 1408, 8),  # about 0.1B parameters, 88% in experts
    "small": MixtralSize("small", 1024, 8, 16, 8, 2816, 8),  # about 0.65B parameters, 85% in experts
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/gpu")
    p.add_argument("--sizes", default="small", help=f"comma-separated of {list(SIZES)}")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated of {list(SETUPS)}")
    p.add_argument("--devices", type=int, default=None, help="processes (default: every visible GPU)")
    p.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "SETUP:SIZE:RESULT_FILE": one run
    args = p.parse_args(argv)
    for kind, given, known in (("size", args.sizes, SIZES), ("setup", args.setups, SETUPS)):
        unknown = [x for x in given.split(",") if x not in known]
        if unknown:
            p.error(f"unknown {kind}(s) {unknown}; choose from {list(known)}")
    return args


def resolve_devices(args: argparse.Namespace) -> int:
    """The process count; refuses (``SystemExit``) fewer than 2, or more GPUs than are visible."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = args.devices or (gpus if args.accelerator == "cuda" else 2)
    if args.accelerator == "cuda" and gpus < max(devices, 2):
        raise SystemExit(
            f"benchmarks.gpu_moe compares expert parallelism across GPUs and needs at least 2 CUDA GPUs"
            f" ({max(devices, 2)} asked for), and {gpus} are visible. For a CPU smoke run: --accelerator cpu."
        )
    if devices < 2:
        raise SystemExit(f"--devices {devices}: expert parallelism needs at least 2 processes.")
    return devices


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    devices = resolve_devices(args)
    if args.one:
        setup, size, result_file = args.one.split(":", 2)
        run_one(setup, SIZES[size], args, devices, result_file)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    passthrough = ["--devices", str(devices), "--accelerator", args.accelerator, "--seq-len", str(args.seq_len)]
    passthrough += ["--warmup", str(args.warmup), "--steps", str(args.steps), "--precision", args.precision]
    for size in args.sizes.split(","):
        for setup in args.setups.split(","):
            with tempfile.TemporaryDirectory() as folder:
                result = Path(folder) / "row.json"
                cmd = [sys.executable, "-m", "benchmarks.gpu_moe", "--one", f"{setup}:{size}:{result}", *passthrough]
                print(f"benchmarks.gpu_moe: {setup} on {size}, {devices} processes ...", flush=True)
                proc = run_command(cmd)
                if proc.returncode == 0 and result.exists():
                    row = json.loads(result.read_text())
                else:
                    tail = (proc.stderr or proc.stdout)[-2000:]
                    print(tail, file=sys.stderr)
                    error = "out of memory" if "OutOfMemoryError" in tail else f"exit {proc.returncode}"
                    row = {"setup": setup, "size": size, "error": error}
            rows.append(row)
            (out / "gpu_moe_results.json").write_text(json.dumps(rows, indent=1))
    table = to_markdown(rows)
    (out / "gpu_moe_report.md").write_text(table)
    print(table)
    return 1 if any("error" in r for r in rows) else 0


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """tokens/s, step time, peak memory, expert bytes and one step's collectives per rank; ratios to fsdp2."""
    ref = {r["size"]: r for r in rows if r["setup"] == REFERENCE and "error" not in r}
    lines = [
        (
            "| size | setup | processes | tokens/s | step (ms) | peak memory (GiB) | expert params per rank (MB)"
            " | all-gather per step (MB) | all-to-all per step (MB) | tokens/s vs fsdp2 | all-gather vs fsdp2 |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['setup']} | {r['error']} |" + " |" * 8)
            continue
        base = ref.get(r["size"])
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}×" if base else "-"
        gathered = (
            f"{r['all_gather_bytes'] / base['all_gather_bytes']:.2f}×" if base and base["all_gather_bytes"] else "-"
        )
        memory = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") is not None else "-"
        lines.append(
            f"| {r['size']} | {r['setup']} | {r['devices']} | {r['tokens_per_s'] / 1e3:.1f}k | {1e3 * r['step_s']:.0f}"
            f" | {memory} | {r['expert_bytes'] / 1e6:.1f} | {r['all_gather_bytes'] / 1e6:.1f}"
            f" | {r['all_to_all_bytes'] / 1e6:.1f} | {speed} | {gathered} |"
        )
    device = next((r["device"] for r in rows if "device" in r), "?")
    return "\n".join([*lines, "", f"Device: {device}."]) + "\n"


# ------------------------------------------------------------------------------------------------- one setup
def run_one(setup: str, size: MixtralSize, args: argparse.Namespace, devices: int, result_file: str) -> None:
    """Train ``setup`` on ``devices`` processes (Lightning launches them); rank 0 writes the row to
    ``result_file``."""
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import MixtralConfig, MixtralForCausalLM

    from lightning_dist import FSDP2Strategy

    cuda = args.accelerator == "cuda"
    total = args.warmup + args.steps
    tokens = torch.randint(0, size.vocab_size, (total * size.batch_size * devices, args.seq_len),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    loader = DataLoader(TensorDataset(tokens), batch_size=size.batch_size, shuffle=False, drop_last=True)
    config = MixtralConfig(**size.config_kwargs(), max_position_embeddings=args.seq_len, attn_implementation="sdpa",
                           experts_implementation="grouped_mm" if cuda else "eager")  # fmt: skip

    class MixtralLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = MixtralForCausalLM(config)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (input_ids,) = batch
            return self.model(input_ids=input_ids, labels=input_ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=cuda)

    ep, chunks = (devices, 2 if setup.endswith("_overlap") else 1) if setup.startswith("expert_parallel") else (1, 1)
    strategy = FSDP2Strategy(expert_parallel_size=ep, expert_dispatch_chunks=chunks)
    timer = TrafficStepTimer(cuda, traffic_step=args.warmup)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=devices, strategy=strategy, precision=args.precision,
        max_steps=total, callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model = MixtralLM()
    trainer.fit(model, loader)
    if trainer.global_rank != 0:
        return
    step = statistics.median(timer.seconds[args.warmup :])
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in experts]
    row = {
        "setup": setup,
        "size": size.name,
        "devices": devices,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "seq_len": args.seq_len,
        "batch_size_per_rank": size.batch_size,
        "step_s": step,
        "tokens_per_s": size.batch_size * devices * args.seq_len / step,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "expert_bytes": sum(t.numel() * t.element_size() for t in local),
        **timer.traffic,
    }
    Path(result_file).write_text(json.dumps(row))


class TrafficStepTimer(StepTimer):
    """:class:`benchmarks.gpu.throughput.StepTimer`, plus the bytes this rank sends in step ``traffic_step`` by collective."""

    def __init__(self, cuda: bool, traffic_step: int) -> None:
        from lightning_dist.profiling import CommCounter

        super().__init__(cuda)
        self.traffic_step = traffic_step
        self.counter = CommCounter()
        self.traffic: dict[str, int] = {}

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.traffic_step:
            self.counter.__enter__()
        super().on_train_batch_start(trainer, pl_module, batch, idx)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        if self.counter.active:
            self.counter.__exit__(None, None, None)
            c = self.counter
            self.traffic = {
                "all_gather_bytes": int(c.total(op="all_gather_into_tensor")),
                "all_to_all_bytes": int(c.total(op="all_to_all_single")),
                "reduce_scatter_bytes": int(c.total(op="reduce_scatter_tensor")),
            }


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
