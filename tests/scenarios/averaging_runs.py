"""Lightning's weight-averaging callbacks under the strategies, against one process: ``WeightAveraging`` with torch's
``get_ema_multi_avg_fn`` (EMA, updated every step, swapped in for validation) and ``StochasticWeightAveraging``
(from the second epoch, SWALR), both in one run of the example GPT (fp64, 3 epochs of 2 steps, validation each
epoch, a checkpoint at step 3: mid-epoch, both averages running).

python tests/scenarios/averaging_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
python tests/scenarios/averaging_runs.py --devices 2 --out r.json --workdir DIR --scenarios fsdp2,fsdp2_resume,...

Each run saves, on rank 0, the whole EMA copy, SWA copy and model (before training ends: what the model trained to)
as ``<name>.pt`` for the test to compare with the reference's; its result holds the validation losses (taken with
the EMA weights swapped in) and the bytes of the averaged copies per rank. ``<strategy>_resume`` resumes the
step-3 checkpoint of the ``<strategy>`` run (which must run first in the same launch), ``<strategy>_from_reference``
the one-process run's single-file checkpoint: each saves what it restored as ``<name>_restored.pt`` and trains one
more step. ``fsdp2_meta_init`` averages a model created on the meta device. Behind ``LIGHTNING_DIST_FULL_MATRIX=1`` (tests/launch.py): the same run under zeropp, context_parallel and
hybrid3d, and the pipeline's resume; ``hybrid3d_pp2_dp2`` needs 4 processes (not in the suite).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import (  # type: ignore[import-not-found]
    SEQ_LEN,
    all_ranks_state,
    full_state,
    is_rank_zero,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, StochasticWeightAveraging, WeightAveraging
from torch.optim.swa_utils import get_ema_multi_avg_fn

from examples.gpt import GPT
from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
)
from lightning_dist.profiling import state_bytes

EPOCHS, STEPS_PER_EPOCH, GLOBAL_BATCH = 3, 2, 8
SAVE_AT = 3  # epoch 1, first batch: EMA updated 3 times, SWA averaged once
EMA_DECAY = 0.8  # far from 1: the averaged weights differ visibly from the model's
VOCAB = 64  # the data has 63 token ids; 64 lets tensor parallelism divide the vocabulary

# name: (strategy, data-parallel size)
STRATEGIES: dict[str, tuple[Callable[[], Any], int]] = {
    "fsdp2": (lambda: FSDP2Strategy(), 2),
    "tensor_parallel": (lambda: TensorParallelStrategy(tensor_parallel_size=2), 1),
    "pipeline": (lambda: PipelineStrategy(), 1),
    # LIGHTNING_DIST_FULL_MATRIX=1 only (the same code paths as the three above)
    "zeropp": (lambda: ZeroPPStrategy(quantized_weights=False, quantized_gradients=False, ranks_per_node=1), 2),
    "context_parallel": (lambda: ContextParallelStrategy(), 1),
    "hybrid3d": (lambda: Hybrid3DStrategy(pipeline_parallel_size=1, tensor_parallel_size=2), 1),
    # 4 processes, run by hand: pipeline stages sharded with FSDP2
    "hybrid3d_pp2_dp2": (lambda: Hybrid3DStrategy(pipeline_parallel_size=2, data_parallel_shard_size=2), 2),
}


class BeforeTrainEnd(Callback):
    """The whole model state when training ends, before the averaging callbacks (later in the list) copy their
    averages into the model; and the validation losses (with the EMA weights swapped in)."""

    def __init__(self) -> None:
        self.current: dict[str, list] = {}
        self.val_losses: list[float] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.current, _ = all_ranks_state(pl_module)


class AfterRestore(Callback):
    """The whole model, EMA copy and SWA copy when training starts: right after a checkpoint was restored."""

    def __init__(self, ema: WeightAveraging, swa: StochasticWeightAveraging) -> None:
        self.ema, self.swa = ema, swa
        self.states: dict[str, dict[str, list]] = {}
        self.counts: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.states = {
            "current": all_ranks_state(pl_module)[0],
            "ema": all_ranks_state(self.ema._average_model.module)[0],
            "swa": all_ranks_state(self.swa._average_model)[0],
        }
        self.counts = {
            "ema_n_averaged": int(self.ema._average_model.n_averaged),
            "swa_n_averaged": self.swa._init_n_averaged,
            "swa_latest_update_epoch": self.swa._latest_update_epoch,
            "swa_scheduler_state": self.swa._scheduler_state is not None,
            "schedulers": len(trainer.lr_scheduler_configs),  # SWA builds its SWALR when its epoch starts
        }


def _callbacks(
    workdir: str, name: str, save: bool
) -> tuple[BeforeTrainEnd, WeightAveraging, StochasticWeightAveraging, list]:
    before = BeforeTrainEnd()
    ema = WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))
    swa = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=2, annealing_epochs=1)
    saving = [ModelCheckpoint(f"{workdir}/{name}", every_n_train_steps=SAVE_AT, save_top_k=-1, filename="{step}")]
    return before, ema, swa, [before, ema, swa, *(saving if save else [])]


def fit(
    devices: int,
    workdir: str,
    name: str,
    strategy: Any,
    dp: int,
    save: bool,
    ckpt_path: str | None = None,
    then_test: bool = False,
) -> dict[str, Any]:
    """Fit with both callbacks; with ``then_test``, ``trainer.test`` the fitted model on the same Trainer (the
    error each rank gets, if any, is in the result)."""
    model, data = make_model_and_data(
        devices, dp_size=dp, train_samples=STEPS_PER_EPOCH * GLOBAL_BATCH, n_layer=2, vocab_size=VOCAB
    )
    # In one process both callbacks copy the model in their setup, before precision="64-true" converts it: their
    # copies would stay float32 (WeightAveraging's foreach lerp then fails on the dtypes). A float64 model avoids it.
    model = model.double()
    before, ema, swa, callbacks = _callbacks(workdir, name, save)
    restored = AfterRestore(ema, swa)
    trainer = L.Trainer(
        **trainer_kwargs(
            devices, strategy=strategy, precision="64-true", enable_checkpointing=save, limit_val_batches=1
        ),
        max_epochs=EPOCHS,
        max_steps=SAVE_AT + 1 if ckpt_path else -1,  # a resume: what was restored, then one step
        callbacks=[restored, *callbacks] if ckpt_path else callbacks,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    ema_copy, swa_copy = ema._average_model, swa._average_model
    ema_state, _ = all_ranks_state(ema_copy.module)
    swa_state, _ = all_ranks_state(swa_copy)
    if is_rank_zero():
        states = {"ema": ema_state, "swa": swa_state, "current": before.current}
        _save_states(states, f"{workdir}/{name}.pt")
        if ckpt_path:
            _save_states(restored.states, f"{workdir}/{name}_restored.pt")
    held = state_bytes(model)
    refusals: list[Any] = []
    if then_test:
        try:
            trainer.test(model, data, verbose=False)
            refusal = None
        except RuntimeError as err:
            refusal = str(err)
        refusals = [None] * dist.get_world_size()
        dist.all_gather_object(refusals, refusal)
    return {
        "restored": restored.counts,
        "test_after_fit": refusals,
        "val_losses": before.val_losses,
        "ema_updates": int(ema_copy.n_averaged),
        "swa_updates": None if swa.n_averaged is None else int(swa.n_averaged),  # None: no SWA epoch started
        "bytes": _max_over_ranks(
            {
                "ema_copy": state_bytes(ema_copy.module)["total"],
                "swa_copy": state_bytes(swa_copy)["total"],
                "model": held["parameters"] + held["buffers"],
            }
        ),
        "ema_copy_type": type(ema_copy).__name__,
    }


def _save_states(states: dict[str, dict[str, list]], path: str) -> None:
    torch.save({k: {n: torch.tensor(v, dtype=torch.float64) for n, v in s.items()} for k, s in states.items()}, path)


def _max_over_ranks(values: dict[str, int]) -> dict[str, int]:
    if not dist.is_initialized():
        return values
    out = {}
    for key, value in values.items():
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[key] = int(t)
    return out


def reference(devices: int, workdir: str) -> dict[str, Any]:
    return fit(devices, workdir, "reference", "auto", 1, save=True)


def reference_resume(devices: int, workdir: str) -> dict[str, Any]:
    """The one-process run resumed from its step-3 checkpoint (by hand, not in the suite)."""
    return fit(devices, workdir, "reference_resume", "auto", 1, False, f"{workdir}/reference/step={SAVE_AT}.ckpt")


def _run(strategy: str, resume_from: str | None = None) -> Callable[[int, str], dict[str, Any]]:
    make, dp = STRATEGIES[strategy]

    def run(devices: int, workdir: str) -> dict[str, Any]:
        if resume_from is None:
            return fit(devices, workdir, strategy, make(), dp, save=True, then_test=strategy == "fsdp2")
        name = f"{strategy}_resume" if resume_from == strategy else f"{strategy}_from_{resume_from}"
        return fit(devices, workdir, name, make(), dp, False, f"{workdir}/{resume_from}/step={SAVE_AT}.ckpt")

    return run


class WeightsAfterSteps(Callback):
    """The whole model after each optimizer step (placed before the averaging callback, which updates after it)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps.append(full_state(pl_module))


def fsdp2_meta_init(devices: int, workdir: str) -> dict[str, Any]:
    """WeightAveraging with a model created under ``Trainer.init_module(empty_init=True)``: on the meta device until
    the strategy materializes it after sharding, later than the callback copies it. The EMA of 3 steps against the
    EMA of the weights recorded after each step."""
    _, data = make_model_and_data(devices, dp_size=2, train_samples=16, vocab_size=VOCAB)
    steps, ema = WeightsAfterSteps(), WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(EMA_DECAY))
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=FSDP2Strategy(), precision="64-true", limit_val_batches=0),
        max_steps=3,
        callbacks=[steps, ema],
    )
    with trainer.init_module(empty_init=True):
        model = GPT(vocab_size=VOCAB, seq_len=SEQ_LEN, d_model=32, n_layer=2, n_head=4, lr=1e-2, warmup_steps=2)
    trainer.fit(model, data)
    expected = steps.steps[0]
    for weights in steps.steps[1:]:
        expected = {k: v + (1 - EMA_DECAY) * (weights[k] - v) for k, v in expected.items()}
    averaged = full_state(ema._average_model.module)
    return {
        "copy_type": type(ema._average_model).__name__,
        "updates": int(ema._average_model.n_averaged),
        "device_given_back": ema._device is None,
        "largest_difference": max((averaged[k] - v).abs().max().item() for k, v in expected.items()),
        "moved": max((steps.steps[-1][k] - v).abs().max().item() for k, v in expected.items()),
    }


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "fsdp2_meta_init": fsdp2_meta_init,
    "reference": reference,
    "reference_resume": reference_resume,
    **{name: _run(name) for name in STRATEGIES},
    "fsdp2_resume": _run("fsdp2", "fsdp2"),
    "tensor_parallel_from_reference": _run("tensor_parallel", "reference"),
    "pipeline_resume": _run("pipeline", "pipeline"),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
