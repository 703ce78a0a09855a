"""PEFT LoRA fine-tuning from pretrained weights (issue 54): a stock ``LlamaForCausalLM`` saved in bf16 in 3 shards
with a tokenizer (``<workdir>/llama``), a LightningModule holding ``get_peft_model(from_config(...),
LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))`` built under ``trainer.init_module(empty_init=True)``, the
strategy given ``initial_weights``. Layouts: ``tp`` (tensor_parallel tp2), ``fsdp2`` (dp2), ``zeropp`` (dp2,
quantization off), ``pp`` (pipeline pp2) at 2 processes, ``hybrid`` (hybrid3d pp2 × tp2) at 4.

- ``<layout>_fp32``: one step in fp32: its loss (the test compares it with one process's ``from_pretrained`` then
  ``get_peft_model``: ``lora_B`` is zero, so the first loss is the pretrained model's);
- ``<layout>_fp64``: 3 steps in fp64, the adapters first set to the reference's (its ``lora_A`` draws:
  ``<workdir>/llama_adapters.pt``), then a checkpoint saved at ``<workdir>/lora_<layout>_llama`` for the test to
  export; ``fsdp2_fp64``
  also writes the merged folder when fit ends (``ExportAtFitEnd`` at ``<workdir>/at_fit_end``);
- ``litgpt_fsdp2_fp64``: litgpt's LoRA ``GPT`` from a litgpt folder (``<workdir>/litgpt``), fsdp2 dp2, as ``fsdp2_fp64``.

python tests/scenarios/lora_pretrained_runs.py --devices 2 --out r.json --workdir DIR --scenarios tp_fp64,fsdp2_fp64
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import SEQ_LEN, LogLines, StepRecorder, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from models import PretrainedLitLoRA, PretrainedLoraLM  # type: ignore[import-not-found]
from torch.distributed.tensor import DTensor, distribute_tensor

from examples.data import TextDataModule
from lightning_dist import (
    ExportAtFitEnd,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
)

GLOBAL_BATCH, STEPS = 4, 3


class AdaptersFrom(L.Callback):
    """At fit start: every adapter tensor set to the reference's value (each rank its slice)."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.set = 0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        values = torch.load(self.file, weights_only=True)
        with torch.no_grad():
            for name, param in pl_module.model.named_parameters():
                if name not in values:
                    continue
                value = values[name].to(param.dtype)
                if isinstance(param, DTensor):
                    local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
                    param.to_local().copy_(local.to_local())
                else:
                    param.copy_(value)
                self.set += 1


def _strategy(layout: str, folder: str) -> tuple[Any, int]:
    """The strategy, and the data-parallel size."""
    if layout == "tp":
        return TensorParallelStrategy(tensor_parallel_size=2, data_parallel_shard_size=1, initial_weights=folder), 1
    if layout == "fsdp2":
        return FSDP2Strategy(initial_weights=folder), 2
    if layout == "zeropp":  # quantization off: exact
        return ZeroPPStrategy(quantized_weights=False, quantized_gradients=False, initial_weights=folder), 2
    if layout == "pp":
        return PipelineStrategy(pipeline_parallel_size=2, initial_weights=folder), 1
    strategy = Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_shard_size=1,
                                initial_weights=folder)  # fmt: skip
    return strategy, 1


def _run(devices: int, workdir: str, layout: str, fp64: bool, kind: str = "llama") -> dict:
    folder = str(Path(workdir) / kind)
    strategy, dp = _strategy(layout, folder)
    L.seed_everything(1234, verbose=False)
    data = TextDataModule(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, train_samples=64, val_samples=4)
    steps, log = StepRecorder(), LogLines("initial_weights")
    adapters = AdaptersFrom(Path(workdir) / f"{kind}_adapters.pt")
    callbacks = [steps, adapters] if fp64 else [steps]
    at_end = (
        ExportAtFitEnd(str(Path(workdir) / "at_fit_end")) if fp64 and layout == "fsdp2" and kind == "llama" else None
    )
    callbacks += [at_end] if at_end is not None else []
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="64-true" if fp64 else "32-true",
                                         limit_val_batches=0, callbacks=callbacks, max_steps=STEPS if fp64 else 1))  # fmt: skip
    with trainer.init_module(empty_init=True):
        module = (
            PretrainedLoraLM(folder, dtype="float64" if fp64 else "float32")
            if kind == "llama"
            else PretrainedLitLoRA(folder)
        )
    trainer.fit(module, data)
    log.close()
    checkpoint = Path(workdir) / f"lora_{layout}_{kind}"
    if fp64:
        trainer.save_checkpoint(checkpoint)
    export = (
        {"seconds": at_end.seconds, "peak_bytes": at_end.report.peak_tensor_bytes} if at_end and at_end.report else {}
    )
    return {"losses": steps.losses, "log": log.lines, "adapters_set": adapters.set, "checkpoint": str(checkpoint),
            "at_fit_end": export}  # fmt: skip


SCENARIOS = {
    f"{layout}_{precision}": (lambda d, w, layout=layout, fp64=precision == "fp64": _run(d, w, layout, fp64))
    for layout in ("tp", "fsdp2", "zeropp", "pp", "hybrid")
    for precision in ("fp32", "fp64")
}
SCENARIOS["litgpt_fsdp2_fp64"] = lambda d, w: _run(d, w, "fsdp2", True, "litgpt")

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
