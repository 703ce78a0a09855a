"""``float8=...`` scenarios (torchao, emulated on the CPU): each FP8 run against the same run without float8, the
layers converted, FSDP2's FP8 all-gather bytes, checkpoints and a resume across strategies.

python tests/scenarios/float8_runs.py --devices 2 --out r.json --workdir DIR \
    --scenarios fsdp2,tensor_parallel,pipeline,context_parallel,llama
python tests/scenarios/float8_runs.py --devices 4 --out r.json --workdir DIR --scenarios hybrid3d
"""

from __future__ import annotations

import shutil
import warnings
from typing import Any

import lightning as L
import torch
from common import (  # type: ignore[import-not-found]
    AllStagesRecorder,
    LogLines,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from models import HFLlama  # type: ignore[import-not-found]
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
)
from lightning_dist.compat.torchao import is_float8_linear
from lightning_dist.profiling import CommCounter

STEPS = 6
MODEL = {
    "vocab_size": 64,
    "d_model": 32,
    "n_layer": 2,
    "n_head": 4,
}  # every block linear is 32×32 or 32×128: all convert


class AllGatherBytes(Callback):
    """Bytes this rank sends in FSDP2's all-gathers (and all-reduces) during training steps 2..STEPS."""

    def __init__(self) -> None:
        self.counter = CommCounter()
        self.steps = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
        if trainer.global_step >= 1:  # step 1 has no precomputed scales yet
            self.counter.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if self.counter.active:
            self.counter.__exit__(None, None, None)
            self.steps += 1

    def per_step(self) -> dict[str, float]:
        ops = {r.op for r in self.counter.records}
        gather = sum(self.counter.total("sent_bytes", op=op) for op in ops if "all_gather" in op)
        reduces = sum(self.counter.total("count", op=op) for op in ops if op.startswith("all_reduce"))
        return {"all_gather": gather / self.steps, "all_reduces": reduces / self.steps}


def _fit(
    devices: int,
    strategy: Any,
    *,
    dp: int,
    callbacks: list = (),
    ckpt_path: str | None = None,
    llama: bool = False,
    precision: str = "32-true",
    **kw: Any,
):
    model, data = make_model_and_data(devices, dp_size=dp, **MODEL)
    if llama:  # a stock transformers LlamaForCausalLM (GQA 4/2: k/v projections 32×16), its loss computed inside
        L.seed_everything(1234, verbose=False)
        model = HFLlama(64)
    recorder, logs = AllStagesRecorder(), LogLines("float8")
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision=precision, **kw),
        max_steps=STEPS,
        callbacks=[recorder, *callbacks],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, data, ckpt_path=ckpt_path)
        finally:
            logs.close()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    return model, {
        "losses": recorder.losses,
        "log": logs.lines,
        "converted": sorted(n for n, m in linears.items() if is_float8_linear(m)),
        "plain": sorted(n for n, m in linears.items() if not is_float8_linear(m)),
        "dtensor_params": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
        "weight_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "optimizer_state_dtypes": sorted(
            {str(v.dtype) for s in trainer.optimizers[0].state.values() for v in s.values() if v.dim() > 0}
        ),
        "emulation_warned": any("checks numerics only" in str(w.message) for w in caught),
    }


def fsdp2(devices: int, workdir: str) -> dict[str, Any]:
    """fsdp2 in fp32 without float8, with rowwise, and with tensorwise (FP8 all-gather; all-gather bytes counted,
    a checkpoint at step 3), then fp32 tensor parallel and tensorwise fsdp2 resuming from that checkpoint."""
    out: dict[str, Any] = {}
    for name, options in (("plain", {}), ("rowwise", {"float8": "rowwise"})):
        counter = AllGatherBytes()
        model, result = _fit(devices, FSDP2Strategy(**options), dp=devices, callbacks=[counter])
        out[name] = {**result, **counter.per_step()}
    shutil.rmtree(f"{workdir}/ckpt", ignore_errors=True)
    every = ModelCheckpoint(dirpath=f"{workdir}/ckpt", every_n_train_steps=3, save_top_k=-1)
    counter = AllGatherBytes()
    strategy = FSDP2Strategy(float8="tensorwise")
    _, result = _fit(devices, strategy, dp=devices, callbacks=[every, counter], enable_checkpointing=True)
    out["tensorwise"] = {**result, **counter.per_step()}
    # The theory: per step each block is gathered twice (forward, and again in backward: reshard_after_forward=True),
    # the root unit (embeddings, final norm, head) once (FSDP2 keeps the root gathered until backward ends);
    # converted weights travel as 1 byte, every other parameter as 4.
    converted = set(out["tensorwise"]["converted"])
    fp32_bytes = fp8_bytes = 0
    for name, p in model.named_parameters():
        gathers = 2 if name.startswith("blocks.") else 1
        fp32_bytes += gathers * p.numel() * 4
        fp8_bytes += gathers * p.numel() * (1 if name.rsplit(".", 1)[0] in converted and p.dim() == 2 else 4)
    out["theory_ratio"] = fp8_bytes / fp32_bytes
    path = f"{workdir}/ckpt/epoch=0-step=3.ckpt"
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    out["checkpoint_dtypes"] = sorted({str(v.properties.dtype) for v in metadata.values() if hasattr(v, "properties")})
    out["checkpoint"] = path  # read back in one process by the test (load_full_checkpoint)
    _, out["resumed_in_tp"] = _fit(devices, TensorParallelStrategy(tensor_parallel_size=devices), dp=1, ckpt_path=path)
    # Back into tensorwise FP8: DCP loads through the plain views of torchao's wrapped weights.
    _, out["resumed_tensorwise"] = _fit(devices, FSDP2Strategy(float8="tensorwise"), dp=devices, ckpt_path=path)
    return out


# The runs below are compared with fsdp2's run without float8: in fp32 every strategy matches one process to 1e-4
# (tests/test_*_parity.py), far inside the FP8 tolerance, so one reference serves them all.
def tensor_parallel(devices: int, workdir: str) -> dict[str, Any]:
    return _fit(devices, TensorParallelStrategy(tensor_parallel_size=devices, float8="rowwise"), dp=1)[1]


def pipeline(devices: int, workdir: str) -> dict[str, Any]:
    """pp=2 in bf16-mixed without float8 for STEPS steps with a checkpoint at step 3, and the same pipeline with
    rowwise FP8 resuming from it."""
    out: dict[str, Any] = {}
    shutil.rmtree(f"{workdir}/bf16", ignore_errors=True)
    every = ModelCheckpoint(dirpath=f"{workdir}/bf16", every_n_train_steps=3, save_top_k=-1)
    bf16 = {"precision": "bf16-mixed", "dp": 1}
    strategy = PipelineStrategy(pipeline_parallel_size=devices)
    _, out["bf16"] = _fit(devices, strategy, callbacks=[every], enable_checkpointing=True, **bf16)
    strategy = PipelineStrategy(pipeline_parallel_size=devices, float8="rowwise")
    _, out["bf16_resumed_in_fp8"] = _fit(devices, strategy, ckpt_path=f"{workdir}/bf16/epoch=0-step=3.ckpt", **bf16)
    return out


def context_parallel(devices: int, workdir: str) -> dict[str, Any]:
    return _fit(devices, ContextParallelStrategy(context_parallel_size=devices, float8="rowwise"), dp=1)[1]


def llama(devices: int, workdir: str) -> dict[str, Any]:
    """A stock transformers Llama under fsdp2, without float8 and with rowwise."""
    _, plain = _fit(devices, FSDP2Strategy(), dp=devices, llama=True)
    _, fp8 = _fit(devices, FSDP2Strategy(float8="rowwise"), dp=devices, llama=True)
    return {"plain": plain, "float8": fp8}


def hybrid3d(devices: int, workdir: str) -> dict[str, Any]:
    strategy = Hybrid3DStrategy(pipeline_parallel_size=2, tensor_parallel_size=2, float8="rowwise")
    return _fit(devices, strategy, dp=1)[1]


if __name__ == "__main__":
    run_scenario_script(
        {
            "fsdp2": fsdp2,
            "tensor_parallel": tensor_parallel,
            "pipeline": pipeline,
            "context_parallel": context_parallel,
            "llama": llama,
            "hybrid3d": hybrid3d,
        }
    )
