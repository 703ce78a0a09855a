"""A real run of what ``lightning-dist dryrun`` rehearses, recorded independently of the package's collective
bookkeeping: run under ``torch.distributed.run``; each rank writes ``<out>/rank<r>.json``.

    python -m torch.distributed.run --nproc-per-node 4 tests/scenarios/dryrun_truth.py OUT --config cfg.yaml

* collectives: torch's profiler and flight recorder (tests/real_collectives.py), from ``on_train_start`` (after the
  strategy's setup) to the end of the first batch: the dry run's ``train`` and ``step`` phases;
* the memory of each of the two steps (the second runs with the optimizer states): :class:`~lightning_dist.profiling.live_memory.LiveMemory` over the real tensors of the training
  step (what the dry run measures over fake ones), and the process's resident high-water mark during the step
  (``VmHWM`` after resetting it, Linux), the operating system's figure.

The profiler starts after setup: while it runs (torch 2.13), ``nn.Module.to_empty`` cannot swap a meta-device
parameter for its materialized DTensor ("Expected no weakrefs").
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_collectives import RealCollectiveLog

from lightning_dist.dryrun.rank_run import build_trainer
from lightning_dist.profiling.live_memory import LiveMemory


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


class AfterSetup(L.Callback):
    def __init__(self) -> None:
        self.recorder = RealCollectiveLog(memory=False)

    def on_train_start(self, *args: object) -> None:
        self.recorder.__enter__()
        self.recorder.mark("begin")

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == 1:
            self.recorder.mark("first_batch_end")

    def on_fit_end(self, *args: object) -> None:
        self.recorder.__exit__(None, None, None)


class StepMemory(L.Callback):
    """LiveMemory over each training batch (``split``: the first, ``second_split``: the second, with the optimizer
    states), and the resident high-water mark's growth over the batches."""

    def __init__(self) -> None:
        self.memory: LiveMemory | None = None
        self.result: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        strategy = trainer.strategy
        self.memory = LiveMemory(strategy.model_parts, strategy.optimizers)
        if "rss_start" not in self.result:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
                self.result["rss_start"] = _status("VmRSS")
            except OSError:
                pass
        self.memory.__enter__()

    def on_train_batch_end(self, *args: object) -> None:
        assert self.memory is not None
        self.memory.__exit__(None, None, None)
        self.result["split" if "split" not in self.result else "second_split"] = self.memory.peak_split()
        if "rss_start" in self.result:
            self.result["rss_growth"] = _status("VmHWM") - self.result["rss_start"]


def main() -> None:
    out, cli_args = Path(sys.argv[1]), sys.argv[2:]
    world_size = int(os.environ["WORLD_SIZE"])
    # the dry run's configuration (meta-device build) for two steps: the second one's memory is what the dry run reports
    cli = build_trainer(cli_args, world_size, 1, steps=2)
    step, window = StepMemory(), AfterSetup()
    cli.trainer.callbacks += [window, step]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    log = window.recorder
    rank = int(os.environ["RANK"])
    first_step = log.collectives_between("begin", "first_batch_end")  # the dry run runs one step
    result = {"collectives": first_step, "groups_aligned": log.groups_aligned, **step.result}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
