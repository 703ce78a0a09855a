"""``mesh="auto"`` on 2 processes whose ranks are told different device memory (as on mixed GPUs): rank 0's plan
gives dp_replicate=2, rank 1's alone would give dp_shard=2. Each rank writes the mesh it trained on and its losses.

python tests/scenarios/mesh_agreement.py WORKDIR
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import lightning as L
from common import StepRecorder, make_model_and_data, trainer_kwargs  # type: ignore[import-not-found]

from lightning_dist import Hybrid3DStrategy

MEMORY_GIB = {0: 0.01, 1: 0.0008}  # planner thresholds for the example GPT at seq 32 (fp32, 2 devices)


def main(workdir: Path) -> None:
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # the launching process is rank 0
    strategy = Hybrid3DStrategy(mesh="auto", sequence_length=32, device_memory_gib=MEMORY_GIB[rank])
    model, data = make_model_and_data(2)
    recorder = StepRecorder()
    trainer = L.Trainer(**trainer_kwargs(2, strategy=strategy), max_steps=2, callbacks=[recorder])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    result = {
        "mesh": str(strategy.parallel_dims),
        "losses": recorder.losses,
        "warnings": [str(w.message) for w in caught if "mesh='auto'" in str(w.message)],
    }
    (workdir / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
