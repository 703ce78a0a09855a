"""An export's ``dtype``: every floating-point tensor written in one dtype (``bfloat16`` halves a model trained in
float32 to the size it was published at), integer and boolean tensors as they are."""

from __future__ import annotations

import torch

from lightning_dist.checkpoint.export.source import TensorSource

#: The dtypes an export writes, by the names ``--dtype`` takes.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_dtype(name: str | None) -> torch.dtype | None:
    """The dtype named ``name`` (``None``: as trained)."""
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or left out: as trained), not {name!r}")
    return DTYPES[name]


class CastTensors:
    """The tensors of ``source`` with every floating-point one in ``dtype``."""

    def __init__(self, source: TensorSource, dtype: torch.dtype) -> None:
        self.source, self.dtype, self.path, self.provenance = source, dtype, source.path, source.provenance
        self.specs = {name: (shape, self._cast(kind)) for name, (shape, kind) in source.specs.items()}

    def _cast(self, kind: torch.dtype) -> torch.dtype:
        return self.dtype if kind.is_floating_point else kind

    def nbytes(self, name: str) -> int:
        shape, kind = self.specs[name]
        return shape.numel() * kind.itemsize

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {name: value.to(self._cast(value.dtype)) for name, value in self.source.read(names).items()}
