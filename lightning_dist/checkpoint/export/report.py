"""What an export wrote, and the most tensor bytes it held at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ExportReport:
    """``out``: the folder; ``files``: the names written in it; ``tensors``: how many; ``peak_tensor_bytes``: the
    most bytes of tensor values read from the checkpoint and held at one time (one shard, or a tied pair being
    compared); ``prefix``: the LightningModule attribute path the model's names were found under."""

    out: Path
    format: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_bytes: int = 0
    peak_tensor_bytes: int = 0
    prefix: str = ""

    def held(self, nbytes: int) -> None:
        self.peak_tensor_bytes = max(self.peak_tensor_bytes, nbytes)
