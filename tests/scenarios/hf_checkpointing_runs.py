"""A stock transformers Llama with its own gradient checkpointing turned on (``model.gradient_checkpointing_enable()``,
as Hugging Face fine-tuning scripts do), under the strategies and in one process, fp64 (the loss from the logits);
``pipeline_reentrant``: with ``use_reentrant=True``, which a pipeline stage cannot run (meant to fail).

python tests/scenarios/hf_checkpointing_runs.py --devices 2 --out r.json --workdir DIR --scenarios pipeline
"""

from __future__ import annotations

from typing import Any

import lightning as L
from common import ALL_RANKS, AllStagesRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from models import HFLlama  # type: ignore[import-not-found]

STEPS = 3


def _train(devices: int, workdir: str, name: str, reentrant: bool = False) -> dict[str, Any]:
    make, every_rank_dp = ALL_RANKS[name]
    _, data = make_model_and_data(devices, dp_size=devices if every_rank_dp else 1, vocab_size=64)
    L.seed_everything(0)
    model = HFLlama(64, logits_loss=True)
    model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    recorder = AllStagesRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=make(devices), precision="64-true"), max_steps=STEPS, callbacks=[recorder]
    )
    trainer.fit(model.double(), datamodule=data)
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms}


SCENARIOS = {
    name: lambda d, w, name=name: _train(d, w, name) for name in ("fsdp2", "tensor_parallel", "pipeline", "one_process")
}
SCENARIOS["pipeline_reentrant"] = lambda d, w: _train(d, w, "pipeline", reentrant=True)

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
