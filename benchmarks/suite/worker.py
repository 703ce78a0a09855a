"""One rank of a benchmark launch: runs every item of a plan in order; rank 0 writes the results as it goes.

Started by :mod:`benchmarks.common.launch` once per rank with a torchrun-style environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``), so Lightning takes the processes as
given and does not spawn its own, and the raw PyTorch loop can share them. Usage::

    python benchmarks/suite/worker.py --plan plan.json --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

import lightning_dist  # noqa: F401
from benchmarks.common.layout import Layout
from benchmarks.common.measure import (
    ActivationCounter,
    StepTimer,
    comm_breakdown,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)
from benchmarks.common.models import SIZES
from benchmarks.suite.baselines import HandShardedGPT, HandTensorParallelGPT, raw_fsdp_loop
from benchmarks.suite.workloads import BY_NAME, Workload
from examples.data import TextDataModule
from examples.gpt import GPT
from lightning_dist.profiling import (
    CommCounter,
    NodeTopology,
    attach_phase_hooks,
    cuda_peak_memory_bytes,
    reset_cuda_peak_memory_stats,
    state_bytes,
)

SEED = 1234


class Probe:
    """Measures steps of one run. ``mode="time"``: every step's wall and CPU time. ``mode="measure"``: on step
    ``measure_step`` only, communication (comm counter), saved activations, peak memory, then state bytes."""

    def __init__(
        self,
        mode: str,
        device: torch.device,
        warmup: int,
        measure_step: int,
        topology: NodeTopology,
    ) -> None:
        self.mode = mode
        self.device = device
        self.timer = StepTimer(device, warmup)
        self.measure_step = measure_step
        self.topology = topology
        self.result: dict[str, Any] = {}
        self._counter: CommCounter | None = None
        self._acts: ActivationCounter | None = None
        self._hooks: Any = None
        self._rss0: int | None = None

    def start(self, step: int, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        if self.mode == "time":
            self.timer.start()
            return
        if step != self.measure_step:
            return
        reset_cuda_peak_memory_stats(self.device if self.device.type == "cuda" else None)
        reset_peak_rss()
        self._rss0 = rss_bytes()
        self._counter = CommCounter(self.topology)
        self._counter.__enter__()
        self._hooks = attach_phase_hooks(model, self._counter, optimizers=optimizers)
        self._acts = ActivationCounter(model).__enter__()

    def end(self, step: int, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        if self.mode == "time":
            self.timer.stop()
            return
        if step != self.measure_step or self._counter is None:
            return
        assert self._acts is not None
        self._acts.__exit__(None, None, None)
        self._hooks.remove()
        self._counter.__exit__(None, None, None)
        cuda = cuda_peak_memory_bytes(self.device) if self.device.type == "cuda" else None
        self.result = {
            "comm": comm_breakdown(self._counter.records),
            "comm_dropped": self._counter.dropped,
            "state": state_bytes(model, optimizers),
            "activations": {"saved_bytes": self._acts.saved_bytes},
            "peak_memory": {
                "rss_at_step_start": self._rss0,
                "peak_rss": peak_rss_bytes(),
                "cuda": cuda,
            },
        }
        self._counter = None


class ProbeCallback(Callback):
    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int):
        self.probe.start(trainer.global_step, trainer.strategy.model, trainer.optimizers)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # global_step has already advanced past the step that just ended.
        self.probe.end(trainer.global_step - 1, trainer.strategy.model, trainer.optimizers)


def _strategy(workload: Workload, layout: Layout) -> tuple[Any, type[GPT], str]:
    """The Trainer's strategy, the model class, and a description of the parallel layout."""
    if workload.kind == "registered":
        entry = StrategyRegistry[workload.strategy]
        options = workload.options(layout)
        strategy = entry["strategy"](**{**entry["init_params"], **options}) if options else workload.strategy
        return strategy, GPT, ""
    if workload.kind == "model_parallel_fsdp":
        strategy = ModelParallelStrategy(data_parallel_size=layout.world_size, tensor_parallel_size=1)
        return strategy, HandShardedGPT, f"data_parallel={layout.world_size}"
    if workload.kind == "model_parallel_tp":
        dp, tp = layout.num_nodes, layout.ranks_per_node
        strategy = ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)
        return strategy, HandTensorParallelGPT, f"data_parallel={dp}, tensor_parallel={tp}"
    raise ValueError(f"unknown workload kind {workload.kind!r}")


def _device(plan: dict[str, Any]) -> torch.device:
    """The device the launcher chose for the run (``benchmarks.run.choose_device``): one GPU per rank, or the CPU."""
    if plan.get("device", "cpu") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def run_item(item: dict[str, Any], plan: dict[str, Any], layout: Layout) -> dict[str, Any]:
    workload = BY_NAME[item["workload"]]
    size = SIZES[item["size"]]
    device = _device(plan)
    batch_size = plan["batch_size"]
    steps = item["warmup"] + item["steps"]
    topology = NodeTopology(layout.ranks_per_node) if layout.num_nodes > 1 else NodeTopology()
    probe = Probe(item["mode"], device, item["warmup"], item["warmup"], topology)
    L.seed_everything(SEED, verbose=False)
    model_kwargs = dict(size.gpt_kwargs(), lr=1e-3, warmup_steps=2)
    data = TextDataModule(
        seq_len=size.seq_len, batch_size=batch_size, train_samples=steps * batch_size * layout.world_size, seed=0
    )
    out: dict[str, Any] = {}
    if workload.kind == "raw_fsdp":
        data.setup("fit")
        raw_fsdp_loop(GPT(**model_kwargs), data.train_set, batch_size, steps, device, SEED, probe.start, probe.end)
        out["parallel"] = f"fully_shard over {layout.world_size} ranks"
    else:
        strategy, model_cls, parallel = _strategy(workload, layout)
        trainer = L.Trainer(
            accelerator=device.type,
            devices=layout.ranks_per_node,
            num_nodes=layout.num_nodes,
            strategy=strategy,
            precision=plan["precision"],
            max_steps=steps,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[ProbeCallback(probe)],
        )
        trainer.fit(model_cls(**model_kwargs), data)
        dims = getattr(trainer.strategy, "parallel_dims", None)
        out["parallel"] = parallel or (str(dims) if dims is not None else f"data_parallel={layout.world_size}")
    if item["mode"] == "time":
        out["step_times"] = probe.timer.times
        out["step_cpu_times"] = probe.timer.cpu_times
    else:
        out.update(probe.result)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    layout = Layout(plan["layout"]["world_size"], plan["layout"]["num_nodes"])
    warnings.filterwarnings("ignore")
    device = _device(plan)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=plan["timeout"]))
    rank = dist.get_rank()
    results: list[dict[str, Any]] = []
    for item in plan["items"]:
        record = {**item, "world_size": layout.world_size, "num_nodes": layout.num_nodes, "device": device.type}
        try:
            record.update(run_item(item, plan, layout))
        except Exception as err:  # noqa: BLE001  (a failing configuration is reported, the rest of the plan still runs)
            record["error"] = f"{type(err).__name__}: {err}"
            if rank == 0:
                traceback.print_exc()
        results.append(record)
        if rank == 0:
            tmp = f"{args.out}.tmp"
            Path(tmp).write_text(json.dumps({"layout": layout.to_dict(), "results": results}))
            os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
