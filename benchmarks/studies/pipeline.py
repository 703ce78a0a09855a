"""Pipeline parallelism, measured on CPU processes over gloo: the bubble of every schedule next to its formula,
the parameter bytes each rank holds, and the step time of ``Trainer(strategy="pipeline")`` against Lightning's DDP.

Usage (from the repository root; 2 CPU processes, a few minutes on 2 cores)::

    python -m benchmarks.pipeline                                 # prints the tables
    python -m benchmarks.pipeline --out benchmarks/results/studies/pipeline.md
    python -m benchmarks.pipeline --repeats 1 --steps 1 --microbatches 4 --bubble-steps 1   # a quick look

What is measured, on the example GPT (``examples/gpt.py``, :data:`MODEL`):

* **bubble** (torch's schedules driven by :class:`lightning_dist.parallel.pipeline.PipelineRunner`, no Lightning):
  the share of a training step each rank spends outside its stages' compute (forward, backward and weight-gradient
  chunks timed by :class:`~lightning_dist.parallel.pipeline.BusyTimer`), averaged over the timed steps and the
  ranks, next to :func:`~lightning_dist.parallel.pipeline.bubble_fraction_formula`: ``(p−1)/(m+p−1)`` with one
  stage per rank, ``(p−1)/(v·m+p−1)`` with ``v`` stages per rank. The idle time includes sending and receiving
  activations and the schedule's own bookkeeping, so it bounds the schedule's bubble from above. The zero-bubble
  schedules split backward into input-gradient (B) and weight-gradient (W) work and fill the bubble with W; their
  theoretical figure is ≈ 0 (equal F, B and W times, enough micro-batches; Qi et al., "Zero Bubble Pipeline
  Parallelism", ICLR 2024), shown next to the interleaved figure of the same ``v`` (which is what
  ``bubble_fraction_formula`` returns for them) for scale. On a loaded host the idle share also counts time a rank
  was descheduled while its peer computed: note the load average printed with the tables.
* **parameter bytes per rank**: counted exactly from the stage modules :func:`cut_pipeline_stages` leaves on each
  rank (distinct parameters), for pp = 2 and 4 against the whole model; at pp=2 also read off the
  ``Trainer(strategy="pipeline")`` ranks of the timed run (``strategy.model_parts``).
* **step time**: ``Trainer(strategy="pipeline")`` (1F1B) and ``"pipeline_gpipe"`` against ``Trainer(strategy="ddp")``
  on the same model and global batch, in the same 2 processes, repeats interleaved (the order rotating every repeat,
  warm-up steps excluded), reported as ratios of medians. This is a CPU/gloo figure on a small shared host: it says
  nothing about GPU step time, where compute per stage, interconnect and overlap are different.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from benchmarks.common.launch import run_ranks
from benchmarks.common.measure import StepTimer, interleaved_order, ratio_stats
from lightning_dist.parallel.pipeline import (
    SCHEDULES,
    BusyTimer,
    PipelineRunner,
    bubble_fraction,
    bubble_fraction_formula,
    cut_pipeline_stages,
    plan_stages,
    resolve_stages_per_rank,
    schedule_info,
    stage_ids_for_rank,
)

MODEL = {"vocab_size": 64, "seq_len": 64, "d_model": 128, "n_layer": 8, "n_head": 4}
BUBBLE_SCHEDULES = list(SCHEDULES)  # every schedule torch 2.13 offers
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
BYTES_SIZES = (2, 4)
# (schedule, split): "auto" balances the blocks counting the embeddings and the head as one block each; "even"
# starts stage i at block i·L/p (whole blocks evenly over the stages, one stage per rank).
BYTES_SCHEDULES = (("1f1b", "auto"), ("1f1b", "even"), ("interleaved_1f1b", "auto"))
TIMED = ("pipeline", "pipeline_gpipe", "one_process", "ddp")  # Trainer strategy names (the last: the baseline)


def GPT_BIG() -> nn.Module:
    """The example GPT of :data:`MODEL` (8 blocks: 4 per stage at pp=2, 1 per stage with 2 stages per rank at pp=4)."""
    from examples.gpt import GPT

    return GPT(**MODEL)


def _logits_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), labels.flatten())


# ---------------------------------------------------------------------------------------------------------- bubble


def measure_bubble(
    rank: int,
    world: int,
    n_microbatches: int,
    steps: int = 4,
    schedules: Sequence[str] = BUBBLE_SCHEDULES,
    build: Callable[[], nn.Module] = GPT_BIG,
    microbatch_size: int = 2,
) -> dict[str, Any]:
    """Idle share of a training step per schedule, on every rank of an initialized process group of ``world``
    ranks (one pipeline over all of them); the result (mean over ranks) is the same on every rank.

    Every schedule runs ``steps`` timed steps of ``microbatch_size · n_microbatches`` sequences after one untimed
    step (which builds the torch stages and infers shapes). A schedule that cannot run this setting is reported with
    its error.
    """
    results: dict[str, Any] = {}
    for schedule in schedules:
        torch.manual_seed(0)
        model = build()
        per_rank = resolve_stages_per_rank(schedule, None)
        try:
            plan = plan_stages(model, world * per_rank)
            stage_ids = stage_ids_for_rank(rank, world, per_rank, schedule_info(schedule).placement)
            parts = cut_pipeline_stages(model, plan, stage_ids, "cpu")
            runner = PipelineRunner(parts, stage_ids, plan.num_stages, schedule, n_microbatches, _logits_loss)
        except ValueError as err:  # a setting the schedule refuses, the same on every rank
            results[schedule] = {"error": str(err), "stages_per_rank": per_rank}
            continue
        hparams = getattr(model, "hparams", {})  # the example GPT's; MODEL's sizes otherwise
        shape = (microbatch_size * n_microbatches, hparams.get("seq_len", MODEL["seq_len"]))
        vocab = hparams.get("vocab_size", MODEL["vocab_size"])
        ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(0))
        timer, fractions, walls = BusyTimer(), [], []
        for step in range(steps + 1):
            dist.barrier()
            timer.instrument(runner.stages)
            timer.take()
            start = time.perf_counter()
            runner.step({"input_ids": ids}, target=ids)
            wall = time.perf_counter() - start
            if step:  # the first step builds the stages and infers shapes
                fractions.append(bubble_fraction(timer.take(), wall))
                walls.append(wall)
            model.zero_grad()
        mine = torch.tensor([sum(fractions) / len(fractions), statistics.median(walls)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        results[schedule] = {
            "measured": sum(float(t[0]) for t in every) / world,
            "per_rank": [float(t[0]) for t in every],
            "step_ms": 1000 * max(float(t[1]) for t in every),
            "formula": bubble_fraction_formula(schedule, world, n_microbatches, per_rank),
            "stages_per_rank": per_rank,
        }
    return results


# ---------------------------------------------------------------------------------------------------------- bytes


def parameter_bytes(modules: Sequence[nn.Module]) -> int:
    """Bytes of the distinct parameters of ``modules`` (a parameter shared by two stage shells counts once)."""
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values())


def even_split(num_blocks: int, num_stages: int) -> list[str]:
    """Module names where stages 1, 2, ... begin when the blocks are spread evenly (``blocks.{i·L/n}``)."""
    return [f"blocks.{i * num_blocks // num_stages}" for i in range(1, num_stages)]


def bytes_per_rank(
    sizes: Sequence[int] = BYTES_SIZES,
    schedules: Sequence[tuple[str, str]] = BYTES_SCHEDULES,
    build: Callable[[], nn.Module] = GPT_BIG,
) -> dict[str, Any]:
    """Parameter bytes each rank holds after the cut, for every pipeline size, schedule and split, counted in this
    process (no process group needed: :func:`cut_pipeline_stages` runs per rank on a fresh copy of the model)."""
    whole = parameter_bytes([build()])
    rows = []
    for schedule, split in schedules:
        per_rank = resolve_stages_per_rank(schedule, None)
        placement = schedule_info(schedule).placement
        for p in sizes:
            for rank in range(p):
                model = build()
                spec = even_split(len(model.blocks), p * per_rank) if split == "even" else split
                plan = plan_stages(model, p * per_rank, spec)
                stage_ids = stage_ids_for_rank(rank, p, per_rank, placement)
                parts = cut_pipeline_stages(model, plan, stage_ids, "cpu")
                rows.append({
                    "schedule": schedule,
                    "split": split,
                    "pp": p,
                    "stages_per_rank": per_rank,
                    "rank": rank,
                    "stages": list(stage_ids),
                    "modules": "; ".join(plan.describe()[s].split(": ", 1)[1] for s in stage_ids),
                    "bytes": parameter_bytes(parts),
                })  # fmt: skip
    return {"whole": whole, "rows": rows}


# ---------------------------------------------------------------------------------------------------------- time


def _trainer_strategy(name: str) -> Any:
    if name == "one_process":
        from lightning.pytorch.strategies import SingleDeviceStrategy

        return SingleDeviceStrategy(torch.device("cpu"))
    return name


def time_fits(
    configs: dict[str, dict[str, Any]],
    build: Callable[[], Any],
    data: Callable[[int], Any],
    warmup: int,
    steps: int,
    repeats: int,
    inspect: Callable[[str, Any], None] | None = None,
) -> dict[str, dict[str, list[float]]]:
    """Time ``Trainer.fit`` steps of every configuration in the processes of this launch, repeats interleaved.

    Args:
        configs: ``name -> {"strategy": Trainer strategy (a name, or "one_process"), "batch_size": per process}``.
            ``"one_process"`` runs on rank 0 alone (a ``SingleDeviceStrategy``) while the other ranks wait.
        build: A fresh, seeded LightningModule.
        data: ``data(batch_size)``: the data module.
        warmup: Leading steps of every fit that are not counted.
        steps: Counted steps of every fit.
        repeats: Fits per configuration; repeat ``r`` runs the configurations in :func:`interleaved_order`.
        inspect: Called as ``inspect(name, trainer)`` on every rank after each configuration's first fit (not for
            ``"one_process"``).

    Returns:
        ``name -> {"wall": [median step seconds per repeat], "cpu": [median process CPU seconds per repeat]}``, rank
        0's figures (the ranks of a synchronous step end together).
    """
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    class _Timer(Callback):
        def __init__(self) -> None:
            self.timer = StepTimer(torch.device("cpu"), warmup)

        def on_train_batch_start(self, *args: Any) -> None:
            self.timer.start()

        def on_train_batch_end(self, *args: Any) -> None:
            self.timer.stop()

    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in configs}
    for repeat in range(repeats):
        for name in interleaved_order(list(configs), repeat):
            config = configs[name]
            alone = config["strategy"] == "one_process"
            dist.barrier()
            if alone and rank != 0:
                continue
            callback = _Timer()
            L.seed_everything(1234, verbose=False)
            trainer = L.Trainer(
                accelerator="cpu",
                devices=1 if alone else world,
                strategy=_trainer_strategy(config["strategy"]),
                max_steps=warmup + steps,
                limit_val_batches=0,
                num_sanity_val_steps=0,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[callback],
            )
            trainer.fit(build(), data(config["batch_size"]))
            out[name]["wall"].append(statistics.median(callback.timer.times))
            out[name]["cpu"].append(statistics.median(callback.timer.cpu_times))
            if repeat == 0 and inspect is not None and not alone:
                inspect(name, trainer)
    dist.barrier()
    return out


def time_ratios(times: dict[str, dict[str, list[float]]], baseline: str) -> list[dict[str, Any]]:
    """One row per configuration other than ``baseline``: its step time over the baseline's (wall and CPU time)."""
    rows = []
    for name, series in times.items():
        if name == baseline:
            continue
        rows.append({
            "name": name,
            "baseline": baseline,
            "wall": ratio_stats(series["wall"], times[baseline]["wall"]),
            "cpu": ratio_stats(series["cpu"], times[baseline]["cpu"]),
            "ms": 1000 * statistics.median(series["wall"]),
            "baseline_ms": 1000 * statistics.median(times[baseline]["wall"]),
        })  # fmt: skip
    return rows


def load_average() -> str:
    """The 1, 5 and 15 minute load averages of the host (what ``uptime`` prints)."""
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------------------------------------- run


def _worker(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result: dict[str, Any] = {"world": world, "load_start": load_average()}
        result["bubble"] = {
            m: measure_bubble(rank, world, m, args.bubble_steps, microbatch_size=args.microbatch_size)
            for m in args.microbatches
        }
        from examples.data import TextDataModule
        from examples.gpt import GPT

        global_batch = args.global_batch
        n_samples = global_batch * (args.warmup + args.steps)
        configs = {name: {"strategy": name, "batch_size": global_batch} for name in TIMED[:-1]}
        configs["ddp"] = {"strategy": "ddp", "batch_size": global_batch // world}
        held: dict[str, list[int]] = {}
        microbatches: dict[str, int] = {}

        def inspect(name: str, trainer: Any) -> None:
            parts = getattr(trainer.strategy, "model_parts", None)
            mine = parameter_bytes(parts if parts is not None else [trainer.lightning_module])
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine)
            held[name] = every
            if hasattr(trainer.strategy, "microbatches_for"):
                microbatches[name] = trainer.strategy.microbatches_for(global_batch)

        times = time_fits(
            configs,
            lambda: GPT(**MODEL, lr=1e-3, warmup_steps=2),
            lambda b: TextDataModule(seq_len=MODEL["seq_len"], batch_size=b, train_samples=n_samples, seed=0),
            args.warmup,
            args.steps,
            args.repeats,
            inspect,
        )
        result.update(times=times, held_by_trainer=held, microbatches=microbatches, load_end=load_average())
        if rank == 0:
            Path(args.worker).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Launch the 2-process worker (bubble and step time) and count the bytes in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp, "result.json")
        options = ["--microbatches", ",".join(map(str, args.microbatches)), "--bubble-steps", str(args.bubble_steps),
                   "--microbatch-size", str(args.microbatch_size),
                   "--warmup", str(args.warmup), "--steps", str(args.steps), "--repeats", str(args.repeats),
                   "--global-batch", str(args.global_batch)]  # fmt: skip
        run_ranks([sys.executable, "-m", "benchmarks.pipeline", "--worker", str(result_path), *options], 2)
        result = json.loads(result_path.read_text())
    result["bytes"] = bytes_per_rank()
    result["config"] = {
        "model": MODEL,
        "global_batch": args.global_batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "bubble_steps": args.bubble_steps,
        "microbatch_size": args.microbatch_size,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    return result


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def bubble_table(result: dict[str, Any]) -> list[str]:
    """The bubble per schedule and micro-batch count, measured next to theory."""
    c, p = result["config"], result["world"]
    lines = [
        (
            f"**Bubble**, pp={p}: idle share of a training step (mean over ranks and {c['bubble_steps']} timed steps;"
            f" micro-batches of {c['microbatch_size']} × {MODEL['seq_len']} tokens; busy = the rank's forward,"
            " backward and weight-gradient compute; idle includes send/receive and schedule overhead)"
        ),
        "",
        "| schedule | v (stages per rank) | m | measured idle | theory | theory formula | per rank | step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, rows in result["bubble"].items():
        for schedule, row in rows.items():
            v = row["stages_per_rank"]
            if "error" in row:
                lines.append(f"| `{schedule}` | {v} | {m} | not run: {row['error']} | | | | |")
                continue
            if schedule in ZERO_BUBBLE:
                theory = f"≈ 0 ({_pct(row['formula'])})"
                formula = "≈ 0 with backward split into B and W (ZB paper); (p−1)/(v·m+p−1) in brackets"
            elif v > 1:
                theory, formula = _pct(row["formula"]), "(p−1)/(v·m+p−1)"
            else:
                theory, formula = _pct(row["formula"]), "(p−1)/(m+p−1)"
            per_rank = " / ".join(_pct(x) for x in row["per_rank"])
            lines.append(
                f"| `{schedule}` | {v} | {m} | **{_pct(row['measured'])}** | {theory} | {formula} | {per_rank}"
                f" | {row['step_ms']:.1f} |"
            )
    return lines


def bytes_table(result: dict[str, Any]) -> list[str]:
    """Parameter bytes per rank for every pipeline size, schedule and split, against one process."""
    whole = result["bytes"]["whole"]
    held = result.get("held_by_trainer", {}).get("pipeline", [])
    lines = [
        (
            f"**Parameter bytes per rank** (fp32; counted exactly from the stage modules each rank keeps; one process"
            f' holds {whole:,} bytes; the last column is read off the `Trainer(strategy="pipeline")` ranks of the'
            " timed run)"
        ),
        "",
        "| schedule | split | pp | rank | stages | modules | bytes | × one process | ideal 1/p | under the Trainer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["bytes"]["rows"]:
        trainer_row = (row["schedule"], row["split"], row["pp"]) == ("1f1b", "auto", result["world"])
        under = f"{held[row['rank']]:,}" if trainer_row and row["rank"] < len(held) else ""
        lines.append(
            f"| `{row['schedule']}` | {row['split']} | {row['pp']} | {row['rank']}"
            f" | {','.join(map(str, row['stages']))} | {row['modules']} | {row['bytes']:,}"
            f" | **{row['bytes'] / whole:.3f}** | {1 / row['pp']:.3f} | {under} |"
        )
    return lines


def ratio_table(times: dict[str, dict[str, list[float]]], baseline: str, header: str) -> list[str]:
    """``header``, then one row per configuration: its step time over ``baseline``'s."""
    lines = [
        header,
        "",
        "| ours / baseline | ratio of medians | per-repeat ratio min – max | ours ms | baseline ms | CPU-time ratio |",
        "|---|---|---|---|---|---|",
    ]
    for row in time_ratios(times, baseline):
        w, cpu = row["wall"], row["cpu"]
        lines.append(
            f"| `{row['name']}` / `{row['baseline']}` | **{w['ratio_of_medians']:.3f}** | {w['pair_min']:.3f} –"
            f" {w['pair_max']:.3f} (n={w['n']}) | {row['ms']:.1f} | {row['baseline_ms']:.1f}"
            f" | {cpu['ratio_of_medians']:.3f} |"
        )
    return lines


def time_header(result: dict[str, Any], what: str) -> str:
    """The line above a step-time table: what ran, on what host, under which load."""
    c = result["config"]
    return (
        f"**Step time, CPU/gloo — not a GPU figure**: {what}; {result['world']} processes × 1 thread on a"
        f" {c['cpus']}-core host; {c['repeats']} interleaved repeats of {c['warmup']} warm-up + {c['steps']} timed"
        f" steps (median per repeat, rank 0); load average (1/5/15 min) {result['load_start']} at the start,"
        f" {result['load_end']} at the end. The CPU-time ratio compares each process's CPU seconds per step (time"
        " spent waiting for a peer or for a free core left out): steadier than wall time on a loaded host"
    )


def to_markdown(result: dict[str, Any]) -> str:
    """The three tables of :func:`measure`'s result."""
    m = result.get("microbatches", {})
    what = (
        f"the example GPT ({MODEL['n_layer']} blocks, d_model {MODEL['d_model']}), global batch"
        f" {result['config']['global_batch']} × {MODEL['seq_len']} tokens (DDP: half per rank; pipeline: "
        + ", ".join(f"`{k}` {v} micro-batches" for k, v in m.items())
        + ")"
    )
    return (
        "\n".join([
            *bubble_table(result),
            "",
            *bytes_table(result),
            "",
            *ratio_table(result["times"], TIMED[-1], time_header(result, what)),
        ])
        + "\n"
    )  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the tables (markdown) and the numbers (.json beside it) here")
    parser.add_argument("--microbatches", type=_ints, default=[4, 8], help="micro-batch counts of the bubble table")
    parser.add_argument("--bubble-steps", type=int, default=4, help="timed steps per schedule in the bubble table")
    parser.add_argument("--microbatch-size", type=int, default=4, help="sequences per micro-batch (bubble table)")
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step (DDP: half per rank)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        _worker(args)
        return
    result = measure(args)
    table = to_markdown(result)
    print(table)
    if args.out:
        Path(args.out).write_text(table)
        Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
