"""One rank of the pretrained-load benchmark (:mod:`benchmarks.studies.pretrained_load`), started by ``run_ranks``
with the environment ``torchrun`` would give it:

    python -m benchmarks.studies.pretrained_load_rank --way initial_weights|from_pretrained --folder F --out DIR

It builds the module the way asked, fits under ``FSDP2Strategy`` (``32-true``) and stops at ``on_train_start``,
recording this process's peak host memory at each stage of setup, then checks that every element of its shard of
every parameter equals the file's value, and writes ``DIR/<way>_rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.callbacks import Callback
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Shard

from lightning_dist import FSDP2Strategy
from lightning_dist.checkpoint.pretrained import read_pretrained_files

WAYS = ("initial_weights", "from_pretrained")
SEQ_LEN = 16


def memory_kib() -> dict[str, int]:
    """``ru_maxrss`` (KiB on Linux: includes what the parent held when it started this process, see the driver's
    docstring), and this address space's own peak and current resident set (``VmHWM``, ``VmRSS``)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "vm_hwm": int(status["VmHWM"].split()[0]),
        "vm_rss": int(status["VmRSS"].split()[0]),
    }


BASELINE = memory_kib()  # after the imports, before any model exists


class CausalLM(L.LightningModule):
    """``self.model``: the folder's causal LM in fp32, built from its config (``initial_weights`` loads the weights)
    or loaded by ``from_pretrained`` in this constructor, on every rank."""

    def __init__(self, folder: str, from_pretrained: bool) -> None:
        super().__init__()
        auto = transformers.AutoModelForCausalLM
        if from_pretrained:
            self.model = auto.from_pretrained(folder, dtype=torch.float32)
        else:  # the config says bf16 (the files'): fp32 weights must be asked for
            self.model = auto.from_config(transformers.AutoConfig.from_pretrained(folder), dtype=torch.float32)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class SetupRecorder(Callback):
    """Memory and time at each stage of setup; stops the fit at ``on_train_start``, before the first step."""

    def __init__(self) -> None:
        self.stages: dict[str, dict[str, Any]] = {}

    def _record(self, stage: str) -> None:
        self.stages[stage] = {**memory_kib(), "at_s": time.perf_counter()}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._record("process_group")  # the processes joined, nothing sharded yet

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record("strategy_setup")  # sharded, materialized, weights loaded

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record("train_start")
        trainer.should_stop = True


def file_slices_equal(module: CausalLM, folder: str) -> dict[str, int]:
    """Every element this rank holds of every parameter, against the file's values (bf16, converted to fp32 as the
    load converts them), reading only this rank's rows. Returns the counts; the caller fails on a difference."""
    files = read_pretrained_files(folder)
    compared = differ = tensors = 0
    for name, param in module.model.named_parameters():
        local, start = param, 0
        if isinstance(param, DTensor):
            assert param.placements == (Shard(0),), (name, param.placements)  # fsdp2: dim-0 shards
            local = param.to_local()
            chunk = -(-param.shape[0] // param.device_mesh.size())  # torch.chunk's rows per shard
            start = min(param.device_mesh.get_coordinate()[0] * chunk, param.shape[0])
        entry = files.tensors[name]
        with safe_open(str(entry.file), framework="pt") as f:
            rows = f.get_slice(name)[start : start + local.shape[0]]
        expected = rows.to(torch.float32)
        compared += local.numel()
        differ += int((local.detach() != expected).sum())
        tensors += 1
    return {"tensors": tensors, "elements": compared, "differ": differ}


READ_S: list[float] = []  # the seconds of initial_weights's read, recorded by the wrapper below


def _timed_reads() -> None:
    """Time each ``load_pretrained`` the strategy calls (the read alone, without the module's set-up)."""
    from lightning_dist.strategies.lifecycle import initial_weights as setup

    load = setup.load_pretrained

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return load(*args, **kwargs)
        finally:
            READ_S.append(time.perf_counter() - start)

    setup.load_pretrained = timed


def run(way: str, folder: str, out: Path) -> None:
    _timed_reads()
    L.seed_everything(0, verbose=False)
    recorder = SetupRecorder()
    strategy = FSDP2Strategy(initial_weights=folder) if way == "initial_weights" else FSDP2Strategy()
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, precision="32-true",
        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[recorder],
    )  # fmt: skip
    built_at = time.perf_counter()
    if way == "initial_weights":
        with trainer.init_module(empty_init=True):
            module = CausalLM(folder, from_pretrained=False)
    else:
        module = CausalLM(folder, from_pretrained=True)
    fit_at = time.perf_counter()
    vocab = module.model.config.vocab_size
    data = torch.utils.data.DataLoader(torch.randint(0, vocab, (8, SEQ_LEN + 1)), batch_size=1)
    trainer.fit(module, data)
    check = file_slices_equal(module, folder)
    stages = recorder.stages
    result = {
        "way": way,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "baseline_kib": BASELINE,
        "stages_kib": {k: {m: v for m, v in s.items() if m != "at_s"} for k, s in stages.items()},
        "peak_kib": {k: stages["train_start"][k] for k in ("ru_maxrss", "vm_hwm")},
        "build_s": fit_at - built_at,
        "fit_to_train_start_s": stages["train_start"]["at_s"] - fit_at,
        "load_s": stages["train_start"]["at_s"] - built_at,  # building the module and the fit's setup
        # the read alone: initial_weights's load_pretrained; from_pretrained's call (its read, the module built on
        # the meta device by transformers)
        "read_s": sum(READ_S) if way == "initial_weights" else fit_at - built_at,
        "strategy_setup_s": stages["strategy_setup"]["at_s"] - stages["process_group"]["at_s"],
        "check": check,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{way}_rank{trainer.global_rank}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--way", choices=WAYS, required=True)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run(args.way, args.folder, args.out)


if __name__ == "__main__":
    main()
