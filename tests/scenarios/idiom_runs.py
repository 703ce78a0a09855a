"""Logging idioms copied from Lightning's docs, under fsdp2, tensor_parallel and DDP: ``self.log(..., param.norm(),
sync_dist=True)`` on a sharded parameter, and ``self.log_dict(grad_norm(self, norm_type=2))`` in
``on_before_optimizer_step``.

python tests/scenarios/idiom_runs.py --devices 2 --out r.json --workdir DIR --scenarios fsdp2,ddp,tensor_parallel
python tests/scenarios/idiom_runs.py --devices 1 --out ref.json --workdir DIR --scenarios one_process
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from common import make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import grad_norm

from examples.gpt import GPT
from lightning_dist import FSDP2Strategy, TensorParallelStrategy

STEPS = 3


class LoggingGPT(GPT):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("w_norm", self.blocks[0].mlp.up.weight.norm(), sync_dist=True)  # resharded after forward: a DTensor
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


class Logged(Callback):
    """The logged values after every step."""

    def __init__(self) -> None:
        self.values: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        self.values.append({k: float(v) for k, v in metrics.items() if k == "w_norm" or k.startswith("grad_2.0")})


def _run(devices: int, strategy: Any, dp: int) -> dict[str, Any]:
    model, data = make_model_and_data(devices, dp_size=dp, vocab_size=64)
    model = LoggingGPT(**dict(model.hparams)).double()
    logged = Logged()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true"), max_steps=STEPS, callbacks=[logged]
    )
    trainer.fit(model, data)
    return {"values": logged.values}


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "fsdp2": lambda d, w: _run(d, FSDP2Strategy(), dp=d),
    "ddp": lambda d, w: _run(d, "ddp", dp=d),
    "tensor_parallel": lambda d, w: _run(d, TensorParallelStrategy(tensor_parallel_size=d), dp=1),
    "one_process": lambda d, w: _run(d, "auto", dp=1),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
