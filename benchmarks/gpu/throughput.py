"""One-GPU throughput comparison: ``python -m benchmarks.run --gpu`` (CUDA only; on CPU it exits with a message).

The workload is a stock ``transformers`` ``LlamaForCausalLM`` built from a config (random weights, no download),
bf16-mixed, fused AdamW, random token ids, ``seq_len`` 2048. The config is written as users write it: ``use_cache``
is left at its default (on). lightning_dist strategies turn the key/value cache off while a training step runs (as
transformers' Trainer does); Lightning's own strategies leave it on, so the ``auto`` rows trace and fill it, as a
user's run does. Each setup runs in a fresh process of its own (clean
peak memory, no compile cache shared between setups), one after the other on GPU 0:

* ``auto`` / ``auto_compile``: Lightning ``strategy="auto"``, without and with ``torch.compile(self.model)`` in
  ``configure_model`` (Lightning's documented way to compile).
* ``fsdp2`` / ``fsdp2_compile``: lightning_dist ``fsdp2`` on one device, without and with ``compile=True``.
* ``fsdp2_user_compile``: ``fsdp2`` with the model compiled by the user in ``configure_model`` (kept, with a warning).
* ``mp_fsdp``: Lightning ``ModelParallelStrategy`` with a hand-written ``configure_model`` (``fully_shard`` on each
  decoder layer, then the root).
* ``fsdp2_fp8_rowwise_compile`` / ``fsdp2_fp8_tensorwise_compile``: ``fsdp2`` with ``float8="rowwise"`` or
  ``"tensorwise"`` (torchao) and ``compile=True``.
* ``fsdp2_sac_compile`` / ``fsdp2_ac_compile``: ``fsdp2`` with ``compile=True`` and ``activation_checkpointing=
  "selective"`` (torchtitan's per-op policy: matmul and attention outputs kept) or ``True`` (every block recomputed):
  the throughput and peak memory that checkpointing trades. Skipped, with the reason in the table, where torchao is missing,
  the strategy has no ``float8`` option, or the GPU is older than SM89.

Step time is the median of ``steps`` timed steps after ``warmup`` untimed ones (the first of which compiles);
tokens/s = batch · seq_len / step time; MFU = tokens/s · (6·N + 12·L·H·S) / the GPU's dense bf16 peak, for every
row (the fp8 rows too, so that they compare; :mod:`lightning_dist.profiling`, N = the active non-embedding
parameters); peak memory is ``torch.cuda.max_memory_allocated``. Each run also carries ``MeshThroughputMonitor``
(logging every ``warmup`` steps): ``logged_tokens_per_s`` / ``logged_mfu`` are its last value, a check of the
callback against the timer. Ratios are against ``auto_compile``; the targets (issue 57) are
``fsdp2_compile`` ≥ 1.15 × ``auto_compile`` and each fp8 row ≥ 1.25 × ``fsdp2_compile`` (FP8 at the ``8b-width``
size).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from benchmarks.common.launch import run_command

REFERENCE = "auto_compile"
SETUPS: dict[str, str] = {
    "auto": "Lightning strategy='auto'",
    "auto_compile": "Lightning strategy='auto' + torch.compile(self.model) in configure_model",
    "fsdp2": "lightning_dist fsdp2",
    "fsdp2_compile": "lightning_dist fsdp2, compile=True",
    "fsdp2_sac_compile": "lightning_dist fsdp2, activation_checkpointing='selective', compile=True",
    "fsdp2_ac_compile": "lightning_dist fsdp2, activation_checkpointing=True (every block), compile=True",
    "fsdp2_user_compile": "lightning_dist fsdp2, user compiles self.model in configure_model",
    "mp_fsdp": "Lightning ModelParallelStrategy, hand-written fully_shard per decoder layer + root",
    "fsdp2_fp8_rowwise_compile": "lightning_dist fsdp2, float8='rowwise', compile=True",
    "fsdp2_fp8_tensorwise_compile": "lightning_dist fsdp2, float8='tensorwise', compile=True",
}
FP8_RECIPES: dict[str, str] = {"fsdp2_fp8_rowwise_compile": "rowwise", "fsdp2_fp8_tensorwise_compile": "tensorwise"}
AC_SETUPS: dict[str, bool | str] = {"fsdp2_sac_compile": "selective", "fsdp2_ac_compile": True}
# (numerator, denominator, least ratio): issue 57's targets
TARGETS: list[tuple[str, str, float]] = [
    ("fsdp2_compile", "auto_compile", 1.15),
    ("fsdp2_fp8_rowwise_compile", "fsdp2_compile", 1.25),
    ("fsdp2_fp8_tensorwise_compile", "fsdp2_compile", 1.25),
]


class ConfigShape:
    """A model config's shape (the dataclass's fields) plus its ``name`` and ``batch_size``."""

    def config_kwargs(self) -> dict[str, Any]:
        """The fields a transformers config takes: all but ``name`` and ``batch_size``."""
        out = asdict(self)  # type: ignore[call-overload]
        del out["name"], out["batch_size"]
        return out


@dataclass(frozen=True)
class LlamaSize(ConfigShape):
    """A ``transformers.LlamaConfig`` shape and the batch it is run with."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int = 32000
    batch_size: int = 8

    @property
    def num_parameters(self) -> int:
        """Parameters of ``LlamaForCausalLM`` (untied embeddings): embeddings, per layer q/k/v/o, gate/up/down and
        two RMSNorms, the final RMSNorm and the head."""
        return self.vocab_size * self.hidden_size + self.num_matmul_parameters + self._norms

    @property
    def num_matmul_parameters(self) -> int:
        """The ``N`` of ``6N``: every projection and the head (not the input embedding, not the norms)."""
        h, kv = self.hidden_size, self.hidden_size // self.num_attention_heads * self.num_key_value_heads
        layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size
        return self.num_hidden_layers * layer + h * self.vocab_size

    @property
    def _norms(self) -> int:
        return (2 * self.num_hidden_layers + 1) * self.hidden_size


SIZES: dict[str, LlamaSize] = {
    # The workload of the issue: hidden 1536, 16 layers, GQA 12/6 (about 0.5B parameters).
    "0.5b": LlamaSize("0.5b", 1536, 16, 12, 6, 4096),
    # A larger one that fills most of an 80 GB GPU under fp32 weights + AdamW + bf16 activations (about 2.4B;
    # roughly 38 GB of weights, gradients and AdamW state plus about 12 GB of activations at batch 2).
    "2.4b": LlamaSize("2.4b", 2560, 32, 20, 4, 6912, batch_size=2),
    # Llama-3-8B's width (hidden 4096, GQA 32/8, FFN 14336, its vocabulary) cut to 8 layers (about 2.8B): the matmuls
    # FP8 is measured on, at a size that compiles and trains in a minute per setup on one GPU.
    "8b-width": LlamaSize("8b-width", 4096, 8, 32, 8, 14336, vocab_size=128256, batch_size=2),
}


def refuse_without_cuda() -> None:
    """Exit with a message when no CUDA GPU is visible (the CPU suite is ``python -m benchmarks.run``)."""
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks.run --gpu needs a CUDA GPU, and none is visible (torch "
            f"{torch.__version__}, cuda available: False). The CPU suite, with its byte and memory tables, is"
            " `python -m benchmarks.run [--quick]`."
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run --gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--gpu", action="store_true", help="(the flag that selects this benchmark in benchmarks.run)")
    p.add_argument("--out", default="benchmarks/results/gpu", help="output folder (default: benchmarks/results/gpu)")
    p.add_argument("--sizes", default="0.5b,2.4b", help=f"comma-separated sizes out of {list(SIZES)}")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated subset of {list(SETUPS)}")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=None, help="override every size's batch")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (the first compiles)")
    p.add_argument("--steps", type=int, default=25, help="timed steps")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # "SETUP:SIZE": run one setup in this process
    args = p.parse_args(argv)
    for kind, given, known in (("size", args.sizes, SIZES), ("setup", args.setups, SETUPS)):
        unknown = [x for x in given.split(",") if x not in known]
        if unknown:
            p.error(f"unknown {kind}(s) {unknown}; choose from {list(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refuse_without_cuda()
    if args.one:
        setup, size = args.one.split(":")
        print(json.dumps(run_one(setup, SIZES[size], args)))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    passthrough = ["--seq-len", str(args.seq_len), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    passthrough += ["--precision", args.precision] + (["--batch-size", str(args.batch_size)] if args.batch_size else [])
    for size in args.sizes.split(","):
        for setup in args.setups.split(","):
            cmd = [sys.executable, "-m", "benchmarks.gpu", "--one", f"{setup}:{size}", *passthrough]
            print(f"benchmarks --gpu: {setup} on {size} ...", flush=True)
            proc = run_command(cmd)
            last = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
            try:
                row = json.loads(last[0]) if proc.returncode == 0 and last else None
            except json.JSONDecodeError:
                row = None
            if row is None:
                tail = (proc.stderr or proc.stdout)[-2000:]
                error = "out of memory" if "OutOfMemoryError" in tail else f"exit {proc.returncode}"
                print(tail, file=sys.stderr)
                row = {"setup": setup, "size": size, "error": error}
            rows.append(row)
            (out / "gpu_results.json").write_text(json.dumps(rows, indent=1))
    table = to_markdown(rows)
    (out / "gpu_report.md").write_text(table)
    print(table)
    return 1 if any("error" in r for r in rows) else 0  # a skipped row (no torchao, no FP8 GPU) is no failure


def measured(row: dict[str, Any]) -> bool:
    """A row with figures (not failed, not skipped)."""
    return "error" not in row and "skipped" not in row


def ratios(rows: list[dict[str, Any]], reference: str = REFERENCE) -> dict[tuple[str, str], float]:
    """tokens/s of each (size, setup) divided by the reference setup's of the same size."""
    ref = {r["size"]: r["tokens_per_s"] for r in rows if r["setup"] == reference and measured(r)}
    return {
        (r["size"], r["setup"]): r["tokens_per_s"] / ref[r["size"]] for r in rows if measured(r) and r["size"] in ref
    }


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target of :data:`TARGETS` and size: the ratio and whether it is met, or why it is not known."""
    lines = []
    for size in dict.fromkeys(r["size"] for r in rows):
        for numerator, denominator, least in TARGETS:
            ratio = ratios(rows, denominator).get((size, numerator))
            if ratio is None:
                missing = [
                    f"{s}: {r.get('skipped') or r.get('error')}"
                    for s in (numerator, denominator)
                    for r in rows
                    if r["setup"] == s and r["size"] == size and not measured(r)
                ]
                state = "not measured" + (f" ({'; '.join(missing)})" if missing else "")
            else:
                state = f"{ratio:.2f}× {'✅ met' if ratio >= least else '❌ missed'}"
            lines.append(f"- {size}: {numerator} / {denominator} ≥ {least:g}×: {state}")
    return lines


def to_markdown(rows: list[dict[str, Any]]) -> str:
    """One table: tokens/s, MFU, peak memory, first-step time, and the ratio to ``auto_compile``; then the
    targets."""
    rel = ratios(rows)
    lines = [
        f"| size | setup | tokens/s | MFU | peak memory (GiB) | first step (s) | vs {REFERENCE} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not measured(r):
            reason = r.get("error") or f"skipped: {r['skipped']}"
            lines.append(f"| {r['size']} | {r['setup']} | {reason} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        memory = f"{r['peak_memory_gib']:.1f}" if r.get("peak_memory_gib") is not None else "-"
        ratio = rel.get((r["size"], r["setup"]))
        lines.append(
            f"| {r['size']} | {r['setup']} | {r['tokens_per_s'] / 1e3:.1f}k | {mfu} | {memory}"
            f" | {r['first_step_s']:.1f} | {f'{ratio:.2f}×' if ratio is not None else '-'} |"
        )
    return "\n".join([*lines, "", "Targets (issue 57):", "", *target_lines(rows)]) + "\n"


def fp8_skip_reason(recipe: str, strategy_class: type | None = None, device: str = "cuda") -> str | None:
    """Why an fp8 row cannot run here (``None``: it can): torchao missing, a strategy without the ``float8`` option,
    or a GPU older than SM89 (FP8 tensor cores start with Ada/Hopper)."""
    import importlib.util

    from lightning_dist import FSDP2Strategy

    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'lightning-dist[fp8]')"
    try:
        (strategy_class or FSDP2Strategy)(compile=True, float8=recipe)
    except TypeError as error:
        return f"this build's fsdp2 strategy has no float8 option ({error})"
    if device == "cuda" and torch.cuda.get_device_capability(0) < (8, 9):
        major, minor = torch.cuda.get_device_capability(0)
        return f"FP8 matmuls need compute capability 8.9 or newer; {torch.cuda.get_device_name(0)} is {major}.{minor}"
    return None


# ------------------------------------------------------------------------------------------------- one setup
def run_one(setup: str, size: LlamaSize, args: argparse.Namespace, device: str = "cuda") -> dict[str, Any]:
    """Train ``setup`` on GPU 0 for warmup + steps steps in this process; the measured row.

    ``device="cpu"`` runs the same code on the CPU (no MFU, no peak memory): the suite's check that every setup
    trains before anyone spends GPU time on it. An fp8 setup that cannot run here returns a row with ``skipped``.
    """
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.common.hardware import compute_dtype, lookup_peak
    from lightning_dist import FSDP2Strategy, MeshThroughputMonitor
    from lightning_dist.profiling import token_flops

    if setup in FP8_RECIPES and (reason := fp8_skip_reason(FP8_RECIPES[setup], device=device)):
        return {"setup": setup, "size": size.name, "skipped": reason}
    batch = args.batch_size or size.batch_size
    total = args.warmup + args.steps
    tokens = torch.randint(
        0, size.vocab_size, (total * batch, args.seq_len), generator=torch.Generator().manual_seed(0)
    )
    loader = DataLoader(TensorDataset(tokens), batch_size=batch, shuffle=False, drop_last=True)
    strategy: Any = {
        "auto": lambda: "auto",
        "auto_compile": lambda: "auto",
        "fsdp2": FSDP2Strategy,
        "fsdp2_compile": lambda: FSDP2Strategy(compile=True),
        "fsdp2_user_compile": FSDP2Strategy,
        **{
            name: (lambda a=ac: FSDP2Strategy(compile=True, activation_checkpointing=a))
            for name, ac in AC_SETUPS.items()
        },
        "mp_fsdp": ModelParallelStrategy,
        **{name: (lambda r=recipe: FSDP2Strategy(compile=True, float8=r)) for name, recipe in FP8_RECIPES.items()},
    }[setup]()
    model = _lightning_module(
        size, user_compile=setup in ("auto_compile", "fsdp2_user_compile"), hand=setup == "mp_fsdp"
    )
    flops_per_token = token_flops(model).per_token(args.seq_len)
    cuda = device == "cuda"
    timer = StepTimer(cuda)
    monitor = MeshThroughputMonitor()  # the callback users log with, checked against the timer
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        strategy=strategy,
        precision=args.precision,
        max_steps=total,
        callbacks=[timer, monitor],
        log_every_n_steps=max(1, args.warmup),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, loader)
    step = statistics.median(timer.seconds[args.warmup :])
    tokens_per_s = batch * args.seq_len / step
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = lookup_peak(name, compute_dtype(args.precision)) if cuda else None
    return {
        "setup": setup,
        "size": size.name,
        "device": name,
        "batch_size": batch,
        "seq_len": args.seq_len,
        "step_s": step,
        "first_step_s": timer.seconds[0],
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / peak if peak else None,
        "flops_per_token": flops_per_token,
        "logged_tokens_per_s": monitor.last_figures.get("tokens_per_s"),
        "logged_mfu": monitor.last_figures.get("mfu"),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "num_parameters": size.num_parameters,
    }


def _lightning_module(size: LlamaSize, user_compile: bool, hand: bool) -> L.LightningModule:
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    class LlamaLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(**size.config_kwargs(), attn_implementation="sdpa")  # use_cache: its default
            self.model = LlamaForCausalLM(config)

        def configure_model(self) -> None:
            if hand:  # what a ModelParallelStrategy user writes
                mesh = self.device_mesh["data_parallel"]
                for layer in self.model.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(self.model, mesh=mesh)
            if user_compile and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
                self.model = torch.compile(self.model)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            (input_ids,) = batch
            return self.model(input_ids=input_ids, labels=input_ids).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    return LlamaLM()


class StepTimer(Callback):
    """Wall time of each training step, synchronized with the GPU at both ends (when ``cuda``)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
