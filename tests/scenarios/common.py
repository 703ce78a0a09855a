"""Shared pieces of the multi-process scenario scripts: the model setup, recorders and result output. The models
the scripts share are in ``models.py``; a script imports from these two and from the package, never from another
script.

A scenario script is run as ``python tests/scenarios/<name>.py --devices N --out result.json ...`` by every rank
(forked from the fork server, ``benchmarks/common/fork_server.py``, or started by Lightning's launcher with
``LIGHTNING_DIST_FORK_LAUNCH=0``); rank 0 writes the JSON result.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler

import lightning_dist  # noqa: F401
from examples.data import TextDataModule
from examples.gpt import GPT
from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
)
from lightning_dist.parallel.grad_clip import total_grad_norm
from lightning_dist.parallel.tensor_parallel import permuted_parameters, to_checkpoint_order
from lightning_dist.profiling import CommCounter, NodeTopology, attach_phase_hooks

SEQ_LEN = 32
GLOBAL_BATCH = 8  # samples per optimizer micro-step across all data-parallel ranks

#: Each strategy over all ``d`` ranks of a run, and ``one_process`` (``"auto"``) for the reference:
#: ``name -> (strategy for d ranks, whether every rank is data-parallel)``; the others split the model over them.
ALL_RANKS: dict[str, tuple[Callable[[int], Any], bool]] = {
    "fsdp2": (lambda d: FSDP2Strategy(), True),
    "tensor_parallel": (lambda d: TensorParallelStrategy(tensor_parallel_size=d), False),
    "pipeline": (lambda d: PipelineStrategy(pipeline_parallel_size=d), False),
    "context_parallel": (lambda d: ContextParallelStrategy(context_parallel_size=d), False),
    "hybrid3d": (lambda d: Hybrid3DStrategy(pipeline_parallel_size=d), False),
    "one_process": (lambda d: "auto", False),
}


class StepRecorder(Callback):
    """Records, per micro-batch, the loss averaged over data-parallel ranks and, per optimizer step, the gradient
    norm before clipping (computed over full, unsharded gradients)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"].detach().clone()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.grad_norms.append(float(total_grad_norm(pl_module.parameters())))


class AllStagesRecorder(StepRecorder):
    """:class:`StepRecorder` whose gradient norm covers every pipeline stage, not only this rank's."""

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        pipelined = getattr(trainer.strategy, "pipelined", False)
        group = trainer.strategy.process_group("pp") if pipelined else None
        self.grad_norms.append(float(total_grad_norm(pl_module.parameters(), stage_group=group)))


def in_checkpoint_order(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A full parameter (or gradient) in the library's row order, as checkpoints hold it."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    permuted = permuted_parameters(model)
    if name in permuted:
        _, dim, order = permuted[name]
        full = to_checkpoint_order(full, dim, order)
    return full.detach().cpu().clone()


class GradRecorder(Callback):
    """Full gradients of every parameter (checkpoint row order) at every optimizer step, before clipping."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.steps.append({n: in_checkpoint_order(pl_module, n, p.grad) for n, p in pl_module.named_parameters()})


# ZeRO++ byte counting on ranks declared as nodes of RANKS_PER_NODE, and the example GPT's sizes those scenarios use
# (large enough that block padding is negligible: a block unit's shard is ~49k elements, the root's ~5k).
RANKS_PER_NODE = 2
ZEROPP_MODEL: dict[str, Any] = {"d_model": 128, "n_layer": 2, "n_head": 4}


class StepBytes(Callback):
    """Counts the collectives of one training step (forward / backward / optimizer) with a CommCounter."""

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.counter = CommCounter(NodeTopology(RANKS_PER_NODE))
        self.hooks: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if trainer.global_step == self.step:
            opts = [o._optimizer if hasattr(o, "_optimizer") else o for o in trainer.optimizers]
            self.hooks = attach_phase_hooks(trainer.strategy.model, self.counter, optimizers=opts)
            self.counter.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.counter.active:
            self.counter.__exit__(None, None, None)
            self.hooks.remove()

    def table(self) -> dict[str, int]:
        c = self.counter
        ag, rs = "all_gather_into_tensor", ("reduce_scatter_tensor", "all_to_all_single")
        out = {
            "forward_all_gather": c.total("cross_node_bytes", op=ag, phase="forward"),
            "backward_all_gather": c.total("cross_node_bytes", op=ag, phase="backward"),
            "reduce_scatter": c.total("cross_node_bytes", op=rs, phase="backward"),
            "total_cross_node": c.total("cross_node_bytes"),
            "total_sent": c.total("sent_bytes"),
            "records": len(c.records),
            "dropped": c.dropped,
        }
        out["other_cross_node"] = out["total_cross_node"] - sum(
            out[k] for k in ("forward_all_gather", "backward_all_gather", "reduce_scatter")
        )
        return mean_over_ranks(out)


def mean_over_ranks(values: dict[str, int]) -> dict[str, float]:
    if not dist.is_initialized():
        return {k: float(v) for k, v in values.items()}
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / dist.get_world_size() for k, v in zip(keys, t.tolist())}


class OneProcessData(TextDataModule):
    """The one-process reference's data: the order Lightning's DistributedSampler gives N ranks, seen by one.

    Lightning always shuffles training data through the DistributedSampler it injects; rank r of N takes
    ``perm[r::N]``, so the union of the N per-rank batches k is ``perm[k·B·N:(k+1)·B·N]`` — exactly what a
    single-replica sampler with the same seed yields with batch size B·N. (Run with use_distributed_sampler=False.)
    """

    def train_dataloader(self) -> DataLoader:
        seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
        sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, shuffle=True, seed=seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True)


def make_model_and_data(
    devices: int,
    dp_size: int | None = None,
    train_samples: int = 256,
    model_class: type[GPT] = GPT,
    **model_kwargs: Any,
) -> tuple[GPT, TextDataModule]:
    """The example GPT (small; or a ``model_class`` derived from it) and data whose *global* batch is the same for
    any number of data-parallel ranks."""
    dp = dp_size if dp_size is not None else devices
    L.seed_everything(1234, verbose=False)
    data_cls = OneProcessData if devices == 1 else TextDataModule
    data = data_cls(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, train_samples=train_samples, val_samples=32)
    kwargs = {
        "vocab_size": data.vocab_size,
        "seq_len": SEQ_LEN,
        "d_model": 32,
        "n_layer": 3,
        "n_head": 4,
        "lr": 1e-2,
        "warmup_steps": 2,
    }
    kwargs.update(model_kwargs)
    return model_class(**kwargs), data


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copy of every parameter (collective when parameters are DTensors)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().cpu().clone()
    return out


def all_ranks_state(model: torch.nn.Module) -> tuple[dict[str, list], float]:
    """Every parameter whole (in checkpoint row order), from whichever ranks hold it (pipeline stages, ModuleList
    experts split over ep), as lists; and the largest difference between copies of one parameter on different ranks (0.0: they are equal).
    Collective."""
    mine = {n: in_checkpoint_order(model, n, p).tolist() for n, p in model.named_parameters()}  # collective
    if not dist.is_initialized():
        return mine, 0.0
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    params: dict[str, list] = {}
    gap = 0.0
    for state in states:
        for name, value in state.items():
            if name in params:
                gap = max(gap, float((torch.tensor(value) - torch.tensor(params[name])).abs().max()))
            params[name] = value
    return params, gap


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default="all")
    parser.add_argument("--workdir", default=None)
    return parser.parse_args()


def is_rank_zero() -> bool:
    if "RANK" in os.environ:  # torchrun sets the global rank; Lightning's launcher sets local and node ranks
        return int(os.environ["RANK"]) == 0
    return int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0


def write_result(path: str, result: dict[str, Any]) -> None:
    if is_rank_zero():
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, path)


def trainer_kwargs(devices: int, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "accelerator": "cpu",
        "use_distributed_sampler": devices > 1,
        "devices": devices,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 2,
    }
    kwargs.update(overrides)
    return kwargs


def run_scenario_script(scenarios: dict[str, Any]) -> None:
    """The ``main`` of a scenario script: run the scenarios named on the command line, rank 0 writes the results."""
    args = parse_args()
    names = list(scenarios) if args.scenarios == "all" else args.scenarios.split(",")
    write_result(args.out, {name: scenarios[name](args.devices, args.workdir) for name in names})


class LogLines(logging.Handler):
    """Collects the strategy's rank-zero decision lines (Lightning's logger), those holding ``word`` if given."""

    def __init__(self, word: str = "") -> None:
        super().__init__(logging.INFO)
        self.word = word
        self.lines: list[str] = []
        logging.getLogger("lightning.pytorch").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self.word in record.getMessage():
            self.lines.append(record.getMessage())

    def close(self) -> None:
        logging.getLogger("lightning.pytorch").removeHandler(self)
        super().close()
