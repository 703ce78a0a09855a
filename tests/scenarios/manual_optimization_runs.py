"""Manual optimization with several optimizers (a GAN's generator and critic, a GPT's blocks and the rest), several
forwards and ``manual_backward`` calls per ``training_step``, against one process (fp64): parameters after the run
and the values logged at every batch.

python tests/scenarios/manual_optimization_runs.py --devices 1 --out r.json --workdir DIR --scenarios gan,gpt,...
python tests/scenarios/manual_optimization_runs.py --devices 2 --out r.json --workdir DIR --scenarios fsdp2_gan,...
python tests/scenarios/manual_optimization_runs.py --devices 4 --out r.json --workdir DIR --scenarios zeropp_gan,...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from common import full_state, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback
from models import QKNormAttention  # type: ignore[import-not-found]
from user_modules import AccumulatingGAN, GANLike, OffsetGAN, TwoOptimizerGPT  # type: ignore[import-not-found]

from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    TensorParallelStrategy,
    ZeroPPStrategy,
)

GAN_BATCHES = 3
ACCUMULATING_BATCHES = 4  # two updates of each optimizer, two batches each
GPT_BATCHES = 2
#: The GAN's layers split over tp (no layer of it is recognised as shardable on its own).
GAN_PLAN = {"generator.0": "colwise", "generator.2": "rowwise", "critic.0": "colwise", "critic.2": "rowwise"}
#: ZeRO++ with exact communication (qwZ and qgZ quantize): fp64 runs match one process to 1e-10.
UNQUANTIZED = {"quantized_weights": False, "quantized_gradients": False}
#: Clipping at this norm changes every update of the GPT (its gradient norms are 0.4 to 1.5).
GPT_CLIP = 0.3
#: Clipping at this norm changes every update of the GAN (its gradient norms are 0.17 to 1.8).
GAN_CLIP = 0.05


class Logged(Callback):
    """The values ``training_step`` logged, at every batch."""

    def __init__(self) -> None:
        self.values: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.values.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def _fit(
    model: L.LightningModule, devices: int, strategy: Any, batches: int, data: Any = None, **trainer: Any
) -> dict[str, Any]:
    logged = Logged()
    kwargs = trainer_kwargs(devices, strategy=strategy, precision="64-true", callbacks=[logged], **trainer)
    L.Trainer(**kwargs, max_epochs=1, limit_train_batches=batches).fit(model, data)
    return {"logged": logged.values, "params": {k: v.tolist() for k, v in full_state(model).items()}}


def gan(devices: int, strategy: Any = "auto", kind: type[GANLike] = GANLike, **options: Any) -> dict[str, Any]:
    """A GAN (own DistributedSampler: the same global batch on any number of ranks)."""
    L.seed_everything(0, verbose=False)
    model = kind(**{"clip": GAN_CLIP, **options}).double()
    batches = ACCUMULATING_BATCHES if kind is AccumulatingGAN else GAN_BATCHES
    return _fit(model, devices, strategy, batches, use_distributed_sampler=False)


def refused(devices: int, strategy: Any, kind: type[GANLike]) -> dict[str, Any]:
    """The error a run stops with (run it last: it fails a fit)."""
    try:
        gan(devices, strategy, kind)
    except RuntimeError as err:
        return {"error": str(err)}
    return {"error": None}


def gpt(devices: int, strategy: Any = "auto") -> dict[str, Any]:
    """The GPT with Qwen3-style q/k norms (their gradients are summed over tp) and clipping."""
    model, data = make_model_and_data(devices, dp_size=1, vocab_size=64, n_layer=2)
    model = TwoOptimizerGPT(clip=GPT_CLIP, **dict(model.hparams))
    for block in model.blocks:
        block.attn = QKNormAttention(model.hparams.d_model, model.hparams.n_head)
    return _fit(model.double(), devices, strategy, GPT_BATCHES, data)


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    # one process: the references
    "gan": lambda d, w: gan(d),
    "gan_plain": lambda d, w: gan(d, clip=0.0, toggle=False),
    "gan_accumulating": lambda d, w: gan(d, kind=AccumulatingGAN),
    "gan_offset": lambda d, w: gan(d, kind=OffsetGAN, toggle=False),
    "gpt": lambda d, w: gpt(d),
    # two processes
    "fsdp2_gan": lambda d, w: gan(d, FSDP2Strategy()),
    "fsdp2_gan_plain": lambda d, w: gan(d, FSDP2Strategy(), clip=0.0, toggle=False),
    "fsdp2_gan_accumulating": lambda d, w: gan(d, FSDP2Strategy(), kind=AccumulatingGAN),
    "fsdp2_gan_offset": lambda d, w: gan(d, FSDP2Strategy(), kind=OffsetGAN, toggle=False),
    "fsdp2_gan_offset_toggled": lambda d, w: refused(d, FSDP2Strategy(), kind=OffsetGAN),  # last: it fails a fit
    "zeropp_gan": lambda d, w: gan(d, ZeroPPStrategy(hpz_partition_size=None, **UNQUANTIZED)),
    "hybrid3d_gan": lambda d, w: gan(d, Hybrid3DStrategy(data_parallel_shard_size=d)),
    "tensor_parallel_gan": lambda d, w: gan(d, TensorParallelStrategy(tensor_parallel_size=d, plan=GAN_PLAN)),
    "tensor_parallel_gpt": lambda d, w: gpt(
        d, TensorParallelStrategy(tensor_parallel_size=d, loss_parallel=True, sequence_parallel=True)
    ),
    "context_parallel_gpt": lambda d, w: gpt(d, ContextParallelStrategy(context_parallel_size=d)),
    # four processes
    "zeropp_hpz_gan": lambda d, w: gan(d, ZeroPPStrategy(ranks_per_node=2, hpz_partition_size=2, **UNQUANTIZED)),
    "hybrid3d_tp_gan": lambda d, w: gan(
        d, Hybrid3DStrategy(data_parallel_shard_size=d // 2, tensor_parallel_size=2, plan=GAN_PLAN)
    ),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
