"""What an export wrote, and the most tensor bytes it held at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ExportReport:
    """``out``: the folder; ``files``: the names written in it; ``tensors``: how many; ``peak_tensor_bytes``: the
    most bytes of tensor values read from the checkpoint and held at one time (one shard, or a tied pair being
    compared); ``prefix``: the LightningModule attribute path the model's names were found under; ``merged``: how many
    LoRA layers were merged into their base weights; ``tokenizer``: where the tokenizer files came from, or why none;
    ``tidied``: what killed exports to ``out`` had left, and what was done with it."""

    out: Path
    format: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_bytes: int = 0
    peak_tensor_bytes: int = 0
    prefix: str = ""
    merged: int = 0
    tokenizer: str = ""
    tidied: list[str] = field(default_factory=list)

    def held(self, nbytes: int) -> None:
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, nbytes)
