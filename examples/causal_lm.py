"""A stock transformers causal LM from a config (``LlamaConfig``, ``DeepseekV3Config``, ...), next-token loss on
random tokens: the module the dry run's scale configurations (``configs/dryrun/``) bring, built the way a user
builds one, ``AutoModelForCausalLM.from_config``."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class CausalLM(L.LightningModule):
    """``transformers.<config_class>(**config)`` made into a model with ``AutoModelForCausalLM.from_config``.

    Args:
        config_class: A transformers config class name (``LlamaConfig``).
        config: Its arguments (sizes, heads, vocabulary...).
        lr: AdamW's learning rate.
    """

    def __init__(
        self, config_class: str = "LlamaConfig", config: dict[str, Any] | None = None, lr: float = 3e-4
    ) -> None:
        super().__init__()
        import transformers

        self.save_hyperparameters()
        settings = getattr(transformers, config_class)(**(config or {}))
        self.model = transformers.AutoModelForCausalLM.from_config(settings)
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class _RandomTokens(Dataset):
    def __init__(self, samples: int, seq_len: int, vocab_size: int) -> None:
        self.samples, self.seq_len, self.vocab_size = samples, seq_len, vocab_size

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


class RandomTokens(L.LightningDataModule):
    """Random token windows: ``samples`` of ``seq_len`` tokens, ``batch_size`` per data-parallel rank."""

    def __init__(self, seq_len: int = 8192, vocab_size: int = 128256, batch_size: int = 1, samples: int = 4096) -> None:
        super().__init__()
        self.seq_len, self.vocab_size, self.batch_size, self.samples = seq_len, vocab_size, batch_size, samples

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_RandomTokens(self.samples, self.seq_len, self.vocab_size), batch_size=self.batch_size)
