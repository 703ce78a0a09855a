"""One rank of a compatibility-matrix launch: runs its cells (a model under a column's strategy) in order and writes
each cell's outcome as it goes; or, with ``--references``, trains the one-process references.

Started by :mod:`benchmarks.compatibility.runner` once per rank with a torchrun-style environment, so Lightning takes the
processes as given and one launch runs many cells. What ``devices=N`` does before it starts the ranks (the
strategy's checks in the launching process, which only there read the first batch) is run first for every cell, in
the references' process, with ``--prelaunch`` (:func:`prelaunch`); a cell that ends there is never launched::

    python benchmarks/compatibility/worker.py --cells gpt2@fsdp2,vit@pipeline --workdir DIR
    python benchmarks/compatibility/worker.py --references gpt2,vit --prelaunch gpt2@fsdp2,vit@pipeline --workdir DIR

Every rank writes ``DIR/cells/<model>@<column>.rank<r>.json``; rank 0 names the cell in progress in
``DIR/current``. After a cell that failed past the pre-launch checks the worker stops (the process group may be in
any state); the runner starts a new launch for the remaining cells.
The references are ``DIR/reference/<model>.json`` (per-step losses) and ``<model>.pt`` (final parameters).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
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
from torch.distributed.tensor import DTensor

import lightning_dist  # noqa: F401  (registers the strategy names)
from benchmarks.compatibility.cells import COLUMNS, FP32_TOLERANCE, FP64_TOLERANCE, compare, describe_failure
from benchmarks.compatibility.models import (
    MODELS,
    STEPS,
    CompatModule,
    dataloader,
    pretrained_folder,
    save_pretrained_folder,
)
from lightning_dist.parallel.tensor_parallel import permuted_parameters, to_checkpoint_order


class LossRecorder(Callback):
    """The loss of every step, as one process would see it (the strategy reduces it over its loss group)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        loss = outputs["loss"].detach().clone()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter this rank holds, whole (a collective over each DTensor's mesh), in the original row order,
    under every name (tied copies included)."""
    state = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        t = p.full_tensor() if isinstance(p, DTensor) else p
        state[name] = t.detach().cpu().clone()
    for name, (_, dim, order) in permuted_parameters(module).items():  # fused q/k/v rows, as the model has them
        state[name] = to_checkpoint_order(state[name], dim, order)
    return state


def _strategy(column_label: str, model: str, workdir: Path) -> Any:
    """The column's ``strategy=`` argument; for a row started from ``initial_weights``, the strategy with it set."""
    strategy = COLUMNS[column_label].make()
    folder = pretrained_folder(workdir, MODELS[model])
    if folder is None:
        return strategy
    if isinstance(strategy, str):
        from lightning.pytorch.strategies import StrategyRegistry

        strategy = StrategyRegistry.get(strategy)
    strategy.initial_weights = folder
    return strategy


def _module(model: str, trainer: L.Trainer) -> CompatModule:
    """The row's module; built on the meta device (``init_module(empty_init=True)``) when it starts from
    ``initial_weights``, as a user of that option builds it."""
    if not MODELS[model].pretrained_from:
        return CompatModule(model)
    with trainer.init_module(empty_init=True):
        return CompatModule(model)


def _trainer(devices: int, strategy: Any, root: Path, recorder: LossRecorder, nodes: int = 1) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=devices // nodes,
        num_nodes=nodes,
        strategy=strategy,
        precision="64-true",
        max_steps=STEPS,
        use_distributed_sampler=devices > 1,
        default_root_dir=str(root),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )


def reference(model: str, workdir: Path) -> dict[str, Any]:
    """Train ``model`` in this one process (Lightning's single-device strategy); save its losses and parameters. A row
    started from ``initial_weights`` has its base row's reference, and its folder of weights is written here."""
    spec, folder = MODELS[model], workdir / "reference"
    if spec.pretrained_from:
        save_pretrained_folder(workdir, spec)
        if not (folder / f"{spec.pretrained_from}.json").exists():
            reference(spec.pretrained_from, workdir)
        for suffix in (".pt", ".json"):
            shutil.copyfile(folder / f"{spec.pretrained_from}{suffix}", folder / f"{model}{suffix}")
        return json.loads((folder / f"{model}.json").read_text())
    module, recorder = CompatModule(model), LossRecorder()
    trainer = _trainer(1, "auto", workdir / "roots" / f"{model}@one_process", recorder)
    trainer.fit(module, dataloader(MODELS[model].task, 1, one_process=True))
    folder = workdir / "reference"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(full_parameters(module), folder / f"{model}.pt")
    result = {"outcome": "trained", "losses": recorder.losses}
    (folder / f"{model}.json").write_text(json.dumps(result))
    return result


class _Launching(BaseException):
    """Raised where Lightning's launcher would start the other ranks: the pre-launch checks have passed."""


def _stop_at_launch() -> None:
    raise _Launching


def prelaunch(model: str, column_label: str, workdir: Path) -> dict[str, Any] | None:
    """What ``Trainer(devices=N, strategy=...).fit`` does in the launching process before it starts the other ranks
    (the strategy's ``preflight``, which only there reads the first batch): run here, in a process of its own, up to
    the moment Lightning's launcher would start the ranks, which is where it stops.

    Returns:
        The cell's record when it ends before launch (a refusal, or a defect), ``None`` when it would launch.
    """
    column = COLUMNS[column_label]
    root = workdir / "roots" / f"{model}@{column_label}"
    trainer = None
    try:
        trainer = _trainer(column.devices, _strategy(column_label, model, workdir), root, LossRecorder(), column.nodes)
        module = _module(model, trainer)
        trainer.strategy.launcher._call_children_scripts = _stop_at_launch
        trainer.fit(module, dataloader(MODELS[model].task, column.batch_replicas, one_process=False))
    except _Launching:
        return None
    except Exception as error:  # noqa: BLE001  (every failure is a cell outcome)
        record = describe_failure(error, 0, constructing=True)
        if record["outcome"] == "defect":
            traceback.print_exc()
        elif root.exists():
            record.update(outcome="defect", defect=f"refused before launch but left {root.name}/ behind")
        return record
    return {"outcome": "defect", "defect": "fit returned in the launching process without launching the ranks"}


def cell(model: str, column_label: str, workdir: Path) -> tuple[dict[str, Any], bool]:
    """Train ``model`` under the column's strategy and compare it with the one-process reference.

    Returns:
        The cell's record, and whether this process may go on with another cell (only after parity or a refusal
        before launch).
    """
    column = COLUMNS[column_label]
    root = workdir / "roots" / f"{model}@{column_label}"
    recorder = LossRecorder()
    trainer = None
    try:
        trainer = _trainer(column.devices, _strategy(column_label, model, workdir), root, recorder, column.nodes)
        module = _module(model, trainer)
        trainer.fit(module, dataloader(MODELS[model].task, column.batch_replicas, one_process=False))
    except Exception as error:  # noqa: BLE001  (every failure is a cell outcome)
        record = describe_failure(error, trainer.global_step if trainer else 0, constructing=trainer is None)
        if record["outcome"] == "defect":
            traceback.print_exc()
        if record["when"] == "before launch" and root.exists():
            record.update(outcome="defect", defect=f"refused before launch but left {root.name}/ behind")
        return record, record["when"] == "before launch"
    ref = json.loads((workdir / "reference" / f"{model}.json").read_text())
    param_diff, missing = _parameter_difference(module, torch.load(workdir / "reference" / f"{model}.pt"))
    tolerance = FP32_TOLERANCE if MODELS[model].why_fp32 else FP64_TOLERANCE
    record = compare(column, recorder.losses, ref["losses"], param_diff, tolerance)
    record["losses"] = recorder.losses
    record["mesh"] = str(trainer.strategy.parallel_dims)
    if record["mesh"] != column.mesh:
        record.update(outcome="defect", defect=f"trained on the mesh {record['mesh']}, not {column.mesh}")
    if missing:
        record.update(outcome="defect", defect=f"parameters no rank holds under their names: {', '.join(missing)}")
    return record, True


def _parameter_difference(module: torch.nn.Module, ref: dict[str, torch.Tensor]) -> tuple[float, list[str]]:
    """The largest difference of any parameter from the reference's (over all ranks), and the reference's parameter
    names no rank holds (a pipeline rank holds its stages only)."""
    state = full_parameters(module)
    diff = max((float((t.double() - ref[n].double()).abs().max()) for n, t in state.items() if n in ref), default=0.0)
    unknown = [n for n in state if n not in ref]
    held: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held, (diff, sorted(state), unknown))
    missing = sorted(set(ref) - {n for _, names, _ in held for n in names})
    missing += [f"{n} (not in the model)" for _, _, names in held for n in names]
    return max(d for d, _, _ in held), sorted(set(missing))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", default="", help="model@column,... (one launch, every column of one world size)")
    parser.add_argument("--references", default="", help="model,...: the one-process references, in this process")
    parser.add_argument("--prelaunch", default="", help="model@column,...: each cell's pre-launch checks, here")
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    workdir = Path(args.workdir)
    for model in filter(None, args.references.split(",")):
        try:
            reference(model, workdir)
        except Exception:  # noqa: BLE001  (the runner records the model's cells as defects; the others go on)
            print(f"one-process reference of {model} failed:", flush=True)
            traceback.print_exc()
    for name in filter(None, args.prelaunch.split(",")):
        path = workdir / "cells" / f"{name}.prelaunch.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"ended": prelaunch(*name.split("@"), workdir)}))
    if not args.cells:
        return
    (workdir / "cells").mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    for name in args.cells.split(","):
        model, column = name.split("@")
        if rank == 0:
            (workdir / "current").write_text(name)
        start = time.perf_counter()
        record, go_on = cell(model, column, workdir)
        record["seconds"] = round(time.perf_counter() - start, 1)
        path = workdir / "cells" / f"{name}.rank{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(record))
        os.replace(path.with_suffix(".tmp"), path)
        if not go_on:
            if rank == 0:  # rank 0 holds the store the others' watchdogs read: let them record this cell first
                peers = [workdir / "cells" / f"{name}.rank{r}.json" for r in range(dist.get_world_size())]
                deadline = time.monotonic() + 30
                while not all(p.exists() for p in peers) and time.monotonic() < deadline:
                    time.sleep(0.2)
            sys.stdout.flush()
            os._exit(0)  # skip the exit handlers: another rank may be stuck in a collective of this cell
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
