"""A small GPT written as plain single-device Lightning code. Nothing in it knows about parallelism."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_dim = d_model // n_head
        self.query = nn.Linear(d_model, d_model, bias=False)
        self.key = nn.Linear(d_model, d_model, bias=False)
        self.value = nn.Linear(d_model, d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (
            lin(x).view(b, s, self.n_head, self.head_dim).transpose(1, 2) for lin in (self.query, self.key, self.value)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, 4 * d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(L.LightningModule):
    """Token embedding → ``n_layer`` transformer blocks → LayerNorm → head; next-token cross-entropy.

    Args:
        vocab_size: Number of token ids.
        seq_len: Longest sequence (size of the learned position embedding).
        d_model: Width of the residual stream.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block.
        dropout: Dropout inside attention (0 keeps runs deterministic).
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up steps of the learning-rate schedule.
    """

    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 64,
        d_model: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.val_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab_size, average="micro")
        self.test_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=vocab_size, average="micro")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch["input_ids"], batch.get("position_ids"))
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        return loss, logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.val_accuracy(logits.argmax(-1).flatten(), batch["labels"].flatten())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_accuracy)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._loss(batch)
        self.test_accuracy(logits.argmax(-1).flatten(), batch["labels"].flatten())
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_acc", self.test_accuracy)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["input_ids"]).argmax(-1)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup = max(1, self.hparams.warmup_steps)
        total = max(self.trainer.estimated_stepping_batches, warmup + 1) if self._trainer is not None else 1000

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total - warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
