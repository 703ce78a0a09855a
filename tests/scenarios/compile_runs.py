"""``compile=True`` scenarios: fsdp2 and tensor_parallel against one process, checkpoints between compiled and
uncompiled runs, and a model the user compiled with ``torch.compile`` (inductor on CPU: gcc compiles the kernels).

python tests/scenarios/compile_runs.py --devices 1 --out ref.json --workdir DIR --scenarios reference
python tests/scenarios/compile_runs.py --devices 2 --out r.json --workdir DIR \
    --scenarios fsdp2,tensor_parallel,pipeline,context_parallel,zeropp,uncompiled_load,user_compiled,user_compiled_kept
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import lightning as L
import torch
from common import (  # type: ignore[import-not-found]
    AllStagesRecorder,
    LogLines,
    full_state,
    is_rank_zero,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback
from torch.distributed.checkpoint import FileSystemReader

from examples.gpt import GPT
from lightning_dist import FSDP2Strategy, Hybrid3DStrategy, PipelineStrategy, TensorParallelStrategy, ZeroPPStrategy
from lightning_dist.compat import is_compiled_in_place

STEPS = 3
PRECISION = "64-true"  # inductor generates fp64 C++ kernels on CPU
MODEL = {"vocab_size": 64, "n_layer": 2}


class StepTimer(Callback):
    """Wall time of each training step (the first one includes compilation)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.seconds.append(time.perf_counter() - self._start)


class UserCompiledGPT(GPT):
    """The example GPT whose user compiles every block in ``configure_model``, as Lightning's docs suggest."""

    def configure_model(self) -> None:
        for i, block in enumerate(self.blocks):
            if not isinstance(block, torch._dynamo.eval_frame.OptimizedModule):
                self.blocks[i] = torch.compile(block)


def checkpoint_keys(path: str) -> list[str]:
    """The model keys of a sharded (DCP) checkpoint folder, from its metadata."""
    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    return sorted(k.removeprefix("state_dict.") for k in keys if k.startswith("state_dict."))


def _fit(
    devices: int, strategy: Any, model: GPT | None = None, steps: int = STEPS, dp: int | None = None
) -> tuple[GPT, L.Trainer, dict]:
    fresh, data = make_model_and_data(devices, dp_size=dp, **MODEL)  # the same global batch for any dp size
    model = model or fresh
    recorder, timer, logs = AllStagesRecorder(), StepTimer(), LogLines("compile")
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision=PRECISION), max_steps=steps, callbacks=[recorder, timer]
    )
    try:
        trainer.fit(model, data)
    finally:
        logs.close()
    return (
        model,
        trainer,
        {
            "losses": recorder.losses,
            "grad_norms": recorder.grad_norms,
            "step_seconds": timer.seconds,
            "compiled_blocks": sum(is_compiled_in_place(b) for b in model.blocks),
            "log": logs.lines,
            "names_with_orig_mod": [n for n, _ in model.named_parameters() if "_orig_mod" in n],
        },
    )


def _save_params(model: GPT, path: str) -> None:
    params = full_state(model)  # collective
    if is_rank_zero():
        torch.save(params, path)


def reference(devices: int, workdir: str) -> dict[str, Any]:
    model, _, result = _fit(devices, "auto")
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{workdir}/reference.pt")
    return result


def fsdp2(devices: int, workdir: str) -> dict[str, Any]:
    model, trainer, result = _fit(devices, FSDP2Strategy(compile=True))
    _save_params(model, f"{workdir}/fsdp2.pt")
    trainer.save_checkpoint(f"{workdir}/compiled.ckpt")
    return {**result, "keys": checkpoint_keys(f"{workdir}/compiled.ckpt")}


def tensor_parallel(devices: int, workdir: str) -> dict[str, Any]:
    strategy = TensorParallelStrategy(tensor_parallel_size=devices, compile=True)
    model, _, result = _fit(devices, strategy, dp=1)  # tensor-parallel peers see the same samples
    _save_params(model, f"{workdir}/tensor_parallel.pt")
    return result


def pipeline(devices: int, workdir: str) -> dict[str, Any]:
    """Two stages, one block each: every rank compiles the blocks of its own stage before the schedule runs them."""
    strategy = PipelineStrategy(compile=True)
    model, _, result = _fit(devices, strategy, dp=1)  # the stages see the same samples
    torch.save(full_state(model), f"{workdir}/pipeline.rank{strategy.global_rank}.pt")  # this rank's stage only
    return result


def context_parallel(devices: int, workdir: str) -> dict[str, Any]:
    """cp=2 through hybrid3d: the compiled blocks call the ring attention that replaces SDPA for the step."""
    model, _, result = _fit(devices, Hybrid3DStrategy(context_parallel_size=2, compile=True), dp=1)
    _save_params(model, f"{workdir}/context_parallel.pt")
    return result


def zeropp(devices: int, workdir: str) -> dict[str, Any]:
    """ZeRO++'s quantized collectives sit at the FSDP units' edges, outside the compiled blocks: the same losses."""
    return {
        name: _fit(devices, ZeroPPStrategy(compile=on))[2]["losses"] for name, on in (("eager", False), ("on", True))
    }


def _validate_from(devices: int, workdir: str, strategy: Any, model: GPT, ckpt: str) -> dict[str, Any]:
    """Load ``ckpt`` through ``validate(ckpt_path=...)`` and compare the loaded parameters with fsdp2's."""
    _, data = make_model_and_data(devices, **MODEL)
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision=PRECISION))
    metrics = trainer.validate(model, data, ckpt_path=ckpt, verbose=False)[0]
    loaded = full_state(model)
    diff = None
    if is_rank_zero():
        saved = torch.load(f"{workdir}/fsdp2.pt")
        assert sorted(saved) == sorted(loaded), (sorted(saved), sorted(loaded))
        diff = max((saved[n] - loaded[n]).abs().max().item() for n in saved)
    return {"loaded_param_diff": diff, "val_loss": float(metrics["val_loss"]), "trainer": trainer}


def uncompiled_load(devices: int, workdir: str) -> dict[str, Any]:
    """The compiled fsdp2 run's checkpoint loads into an uncompiled fsdp2 run; that run saves one without compile."""
    model, _ = make_model_and_data(devices, **MODEL)
    result = _validate_from(devices, workdir, FSDP2Strategy(), model, f"{workdir}/compiled.ckpt")
    result.pop("trainer").save_checkpoint(f"{workdir}/uncompiled.ckpt")
    return {**result, "keys": checkpoint_keys(f"{workdir}/uncompiled.ckpt")}


def user_compiled(devices: int, workdir: str) -> dict[str, Any]:
    """A user-compiled model under compile=True: unwrapped and compiled per block; loads the uncompiled checkpoint."""
    model = UserCompiledGPT(**make_model_and_data(devices, **MODEL)[0].hparams)
    logs = LogLines("compile")
    try:
        result = _validate_from(devices, workdir, FSDP2Strategy(compile=True), model, f"{workdir}/uncompiled.ckpt")
    finally:
        logs.close()
    result.pop("trainer").save_checkpoint(f"{workdir}/user_compiled.ckpt")
    return {
        **result,
        "keys": checkpoint_keys(f"{workdir}/user_compiled.ckpt"),
        "log": logs.lines,
        "names_with_orig_mod": [n for n, _ in model.named_parameters() if "_orig_mod" in n],
        "compiled_blocks": sum(is_compiled_in_place(b) for b in model.blocks),
    }


def user_compiled_kept(devices: int, workdir: str) -> dict[str, Any]:
    """Blocks compiled before fit, no compile option: kept (compiled in place) with one warning; clean keys."""
    model = make_model_and_data(devices, **MODEL)[0]
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, trainer, result = _fit(devices, FSDP2Strategy(), model=model, steps=1)
    trainer.save_checkpoint(f"{workdir}/user_kept.ckpt")
    return {
        **result,
        "keys": checkpoint_keys(f"{workdir}/user_kept.ckpt"),
        "warnings": [str(w.message) for w in caught if "torch.compile()" in str(w.message)],
    }


if __name__ == "__main__":
    run_scenario_script(
        {
            "reference": reference,
            "fsdp2": fsdp2,
            "tensor_parallel": tensor_parallel,
            "pipeline": pipeline,
            "context_parallel": context_parallel,
            "zeropp": zeropp,
            "uncompiled_load": uncompiled_load,
            "user_compiled": user_compiled,
            "user_compiled_kept": user_compiled_kept,
        }
    )
