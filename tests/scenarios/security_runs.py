"""Crafted checkpoints (built by the test in the workdir) used for resume and validation in real processes: every
use must end in a ``CheckpointError`` on every rank and run none of the payloads (nor read the file outside the
folder that one of them names); then a checkpoint whose module saved a custom object is refused by default and
resumes with ``weights_only=False``.

python tests/scenarios/security_runs.py --devices 2 --out r.json --workdir DIR --scenarios crafted,trusted
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from common import make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from crafted_checkpoints import (  # type: ignore[import-not-found]
    PROCESS_CASES,
    PROCESS_ESCAPING,
    CustomState,
    crafted_file_name,
)

import lightning_dist
from examples.gpt import GPT

VOCAB = 64  # divisible by tp


def _strategy(name: str) -> Any:
    return {
        "fsdp2": lambda: lightning_dist.FSDP2Strategy(),
        "tensor_parallel": lambda: lightning_dist.TensorParallelStrategy(tensor_parallel_size=2),
        "pipeline": lambda: lightning_dist.PipelineStrategy(pipeline_parallel_size=2, n_microbatches=2),
    }[name]()


def _outcome(run: Any, *args: Any, **kwargs: Any) -> dict[str, str]:
    try:
        run(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 (recorded for the test)
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": "", "message": "loaded"}


def crafted(devices: int, workdir: str) -> dict[str, Any]:
    outcomes: dict[str, Any] = {}
    uses = [("fit", s) for s in ("fsdp2", "tensor_parallel", "pipeline")] + [("validate", "fsdp2")]
    for fn, strategy in uses:
        # the escaping index is refused by the same check under every strategy: resumed under one
        escaping = PROCESS_ESCAPING if (fn, strategy) == ("fit", "fsdp2") else ()
        for name in PROCESS_CASES + escaping:
            path = Path(workdir) / crafted_file_name(name)
            model, data = make_model_and_data(devices, 1 if strategy != "fsdp2" else devices, vocab_size=VOCAB)
            trainer = L.Trainer(**trainer_kwargs(devices, strategy=_strategy(strategy)), max_steps=1)
            outcomes[f"{fn} {strategy} {name}"] = _outcome(
                getattr(trainer, fn), model, datamodule=data, ckpt_path=str(path)
            )
    return outcomes


class _SavesCustomState(GPT):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["custom"] = CustomState(7)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.restored = checkpoint["custom"].value


def trusted(devices: int, workdir: str) -> dict[str, Any]:
    path = f"{workdir}/custom.ckpt"
    model, data = make_model_and_data(devices, vocab_size=VOCAB)
    model.__class__ = _SavesCustomState
    trainer = L.Trainer(**trainer_kwargs(devices, strategy="fsdp2"), max_steps=2)
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(path)
    saved = trainer.global_step

    def resume(**kwargs: Any) -> L.Trainer:
        model, data = make_model_and_data(devices, vocab_size=VOCAB)
        model.__class__ = _SavesCustomState
        trainer = L.Trainer(**trainer_kwargs(devices, strategy="fsdp2"), max_steps=saved + 1)
        trainer.fit(model, datamodule=data, ckpt_path=path, **kwargs)
        return trainer

    refused = _outcome(resume)
    trainer = resume(weights_only=False)
    return {
        "refused_by_default": refused["message"] if refused["error"] == "CheckpointError" else None,
        "restored_value": trainer.lightning_module.restored,
        "saved_global_step": saved,
        "resumed_global_step": trainer.global_step,
    }


if __name__ == "__main__":
    run_scenario_script({"crafted": crafted, "trusted": trusted})
