"""A 2-process fit and validate whose ranks each print, as the very last thing at exit, the communication threads
(gloo, NCCL, the TCP store) still running: the strategy's exit handler must have joined them all. With ``global``
the model and Trainer stay referenced until exit, as in a script written at module level or under LightningCLI.

python tests/scenarios/exit_threads.py fsdp2 [global]
"""

from __future__ import annotations

import atexit
import os
import sys

import lightning as L
from common import make_model_and_data, trainer_kwargs  # type: ignore[import-not-found]

import lightning_dist  # noqa: F401  (registers the strategy names)

COMMUNICATION_THREADS = ("pt_gloo", "gloo_", "pt_tcpstore", "pt_nccl")
rank = {"global": -1}


def report_threads() -> None:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    left = sorted(name for name in names if name.startswith(COMMUNICATION_THREADS))
    print(f"rank {rank['global']}: communication threads at exit: {left}", flush=True)


atexit.register(report_threads)  # registered before the strategy's handler, so it runs after it


def main(strategy: str) -> tuple[L.LightningModule, L.Trainer]:
    model, data = make_model_and_data(2, vocab_size=64)  # tp=2 divides it
    trainer = L.Trainer(**trainer_kwargs(2, strategy=strategy), max_steps=2)
    trainer.fit(model, data)
    trainer.validate(model, data, verbose=False)
    rank["global"] = trainer.global_rank
    return model, trainer


if __name__ == "__main__":
    kept = main(sys.argv[1])
    if sys.argv[2:] != ["global"]:
        del kept
