"""A 2-process fit in which rank 1 is still busy (a slow ``on_train_end``) when rank 0 has finished and exits. Each
rank writes ``exited.rank<r>`` from an exit handler, which ``os._exit`` would skip: a rank ended by its watchdog
(rank 0's store is gone with rank 0) leaves no file.

python tests/scenarios/late_rank.py WORKDIR
"""

from __future__ import annotations

import atexit
import sys
import time
from pathlib import Path

import lightning as L
from common import make_model_and_data, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback

import lightning_dist  # noqa: F401  (registers the strategy names)

LATE_SECONDS = 2.5  # more than two polls of the watchdog


class SlowEndOnRankOne(Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 1:
            time.sleep(LATE_SECONDS)


def main(workdir: Path) -> None:
    model, data = make_model_and_data(2)
    trainer = L.Trainer(**trainer_kwargs(2, strategy="fsdp2"), max_steps=2, callbacks=[SlowEndOnRankOne()])
    trainer.fit(model, data)
    rank = trainer.global_rank
    atexit.register(lambda: (workdir / f"exited.rank{rank}").write_text("clean exit\n"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
