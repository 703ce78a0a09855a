"""A model whose forward updates buffers (BatchNorm's running statistics) under the pipeline and in one process.

- ``batch_norm_pipeline``: pp=2, batches of 8 in 4 micro-batches of 2 (the default for 1F1B), two SGD steps, fp64.
- ``batch_norm_accumulated``: one process, batches of 2, ``accumulate_grad_batches=4``: the same samples in the same
  order, normalized per micro-batch as the pipeline does.

python tests/scenarios/pipeline_buffers_runs.py --devices 2 --out r.json --workdir DIR --scenarios batch_norm_pipeline
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
from common import StepRecorder, all_ranks_state, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import PipelineStrategy

STEPS = 2
BATCH = 8
MICROBATCHES = 4


class NormalizedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.linear(x)))


class BatchNormRegressor(L.LightningModule):
    """Four Linear + BatchNorm blocks and a head: a tabular regressor as users write one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([NormalizedBlock() for _ in range(4)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _batch_norm(devices: int, workdir: str, batch_size: int, accumulate: int, strategy: Any) -> dict[str, Any]:
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, dtype=torch.float64) * 3 + 1, torch.randn(32, 1, dtype=torch.float64))
    model = BatchNormRegressor()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, use_distributed_sampler=False, precision="64-true"),
        accumulate_grad_batches=accumulate,
        max_steps=STEPS,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(data, batch_size=batch_size))
    state, _ = all_ranks_state(model)
    buffers = {name: buffer.tolist() for name, buffer in model.named_buffers()}
    if torch.distributed.is_initialized():
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, buffers)
        buffers = {name: value for ranks in gathered for name, value in ranks.items()}
    return {
        "state": state,
        "buffers": buffers,
        "warnings": [str(w.message) for w in caught if "BatchNorm" in str(w.message)],
    }


class InterleavedLitGPT(L.LightningModule):
    """litgpt's GPT with 4 layers (rotary cache buffers on the root, which every stage shell shares)."""

    def __init__(self) -> None:
        super().__init__()
        from litgpt.config import Config
        from litgpt.model import GPT

        torch.manual_seed(0)
        config = Config(
            block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=4, n_head=4, n_query_groups=2, n_embd=32,
            bias=False, norm_class_name="LayerNorm", mlp_class_name="LLaMAMLP", intermediate_size=64,
        )  # fmt: skip
        self.gpt = GPT(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.gpt(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _litgpt(devices: int, workdir: str, strategy: Any) -> dict[str, Any]:
    """Two steps of litgpt's GPT, fp64: the losses (an interleaved schedule holds two stages per rank)."""
    data = TensorDataset(torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(1)))
    model = InterleavedLitGPT()
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, use_distributed_sampler=False, precision="64-true"),
        max_steps=STEPS,
        callbacks=[recorder],
    )
    trainer.fit(model, DataLoader(data, batch_size=BATCH))
    return {"losses": recorder.losses}


SCENARIOS = {
    "litgpt_interleaved": lambda d, w: _litgpt(
        d, w, PipelineStrategy(pipeline_parallel_size=d, schedule="interleaved_1f1b", n_microbatches=MICROBATCHES)
    ),
    "litgpt_one_process": lambda d, w: _litgpt(d, w, "auto"),
    "batch_norm_pipeline": lambda d, w: _batch_norm(
        d, w, BATCH, 1, PipelineStrategy(pipeline_parallel_size=d, n_microbatches=MICROBATCHES)
    ),
    "batch_norm_accumulated": lambda d, w: _batch_norm(d, w, BATCH // MICROBATCHES, MICROBATCHES, "auto"),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
