"""Lightning's demo ``nn.Transformer`` (``nn.MultiheadAttention`` inside) trained under a strategy for a few steps.

python tests/scenarios/demo_transformer.py fsdp2 2
"""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.demos import Transformer
from torch.utils.data import DataLoader, Dataset

import lightning_dist  # noqa: F401

STEPS = 3


class Tokens(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 100, (17,), generator=torch.Generator().manual_seed(index))
        return tokens[:-1], tokens[1:]


class DemoTransformer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=100, nlayers=2, nhid=32, ninp=32, nhead=2)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        return F.nll_loss(self.model(inputs, target), target.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    strategy, devices = sys.argv[1], int(sys.argv[2])
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(DemoTransformer(), DataLoader(Tokens(), batch_size=4))
