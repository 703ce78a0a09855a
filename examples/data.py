"""A small character-level text dataset generated on the fly (nothing is downloaded).

The text comes from a tiny random grammar, so it has structure a small model can learn within a minute on a CPU.
"""

from __future__ import annotations

import random

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

VOCAB = "\n .,;!?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123"  # 64 symbols
_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "our teacher", "the robot", "Alice", "Bob"]
_VERBS = ["sees", "likes", "finds", "builds", "paints", "follows", "calls", "helps"]
_OBJECTS = ["the house", "a red ball", "the river", "some bread", "a small boat", "the moon", "the garden"]
_ENDINGS = [".", "!", "?", " today.", " again.", " at night."]


def generate_text(num_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    length = 0
    while length < num_chars:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}"
        sentence = sentence[0].upper() + sentence[1:] + ("\n" if rng.random() < 0.2 else " ")
        parts.append(sentence)
        length += len(sentence)
    return "".join(parts)[:num_chars]


def encode(text: str) -> torch.Tensor:
    table = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([table[ch] for ch in text], dtype=torch.long)


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len`` tokens; labels are the next tokens, already aligned per position."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = index * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1]
        return {"input_ids": chunk[:-1], "labels": chunk[1:]}


class TextDataModule(L.LightningDataModule):
    """Generated text split into train/val/test windows.

    Args:
        seq_len: Tokens per sample.
        batch_size: Samples per batch *per data-parallel rank* (the global batch is this × data-parallel size).
        train_samples: Number of training windows.
        val_samples: Number of validation (and test) windows.
        shuffle: Shuffle the training windows each epoch.
        seed: Seed of the text generator.
    """

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 8,
        train_samples: int = 2048,
        val_samples: int = 128,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.shuffle = shuffle
        self.seed = seed
        self.vocab_size = len(VOCAB)

    def setup(self, stage: str | None = None) -> None:
        def windows(samples: int, seed: int) -> TokenWindows:
            return TokenWindows(encode(generate_text(samples * self.seq_len + 1, seed)), self.seq_len)

        self.train_set = windows(self.train_samples, self.seed)
        self.val_set = windows(self.val_samples, self.seed + 1)
        self.test_set = windows(self.val_samples, self.seed + 2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.batch_size)
