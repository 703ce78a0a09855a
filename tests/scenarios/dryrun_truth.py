"""A real run of what ``lightning-dist dryrun`` rehearses, recorded independently of the package (torch's profiler
and flight recorder, tests/real_collectives.py): run under ``torch.distributed.run``; each rank writes
``<out>/rank<r>.json`` with its collectives in order and its allocator peak during the training step.

    python -m torch.distributed.run --nproc-per-node 4 tests/scenarios/dryrun_truth.py OUT --config cfg.yaml
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_collectives import RealCollectiveLog

from lightning_dist.dryrun.rank_run import build_trainer


class StepMarks(L.Callback):
    def __init__(self, log: RealCollectiveLog) -> None:
        self.log = log

    def on_train_batch_start(self, *args: object) -> None:
        self.log.mark("step_start")

    def on_train_batch_end(self, *args: object) -> None:
        self.log.mark("step_end")


def main() -> None:
    out, cli_args = Path(sys.argv[1]), sys.argv[2:]
    world_size = int(os.environ["WORLD_SIZE"])
    with RealCollectiveLog() as log:  # before the model is built: its parameters count in the allocator's total
        cli = build_trainer(cli_args, world_size, 1)  # the dry run's configuration: one step, meta-device build
        cli.trainer.callbacks.append(StepMarks(log))
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rank = int(os.environ["RANK"])
    result = {"collectives": log.collectives, "groups_aligned": log.groups_aligned,
              "step_peak": log.peak_between("step_start", "step_end"), "unrecognized": log.unrecognized}  # fmt: skip
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
