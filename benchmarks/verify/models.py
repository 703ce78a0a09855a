"""The rows of the verify matrix (:mod:`benchmarks.verify.matrix`): the example GPT and the third-party models of the
compatibility matrix named in issue 27's acceptance (Llama, tied GPT-2, BERT, litgpt), each with a data module
whose loaders give verify a ``batch_size`` per data-parallel rank (verify scales it for the one-process reference).

Every model sees the same global batch under every column (:data:`~benchmarks.compatibility.models.GLOBAL_BATCH` samples per
optimizer step), so a matrix run trains each model's reference once per number of data-parallel ranks and dtype
(verify's ``reference_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import lightning as L
from torch.utils.data import DataLoader

from benchmarks.compatibility.models import DESCRIPTIONS, GLOBAL_BATCH, MODELS, SEED, TITLES, CompatModule, _Samples

GPT_LAYERS = 2  # the example GPT of the acceptance: 2 layers
#: The columns the issue's acceptance asks a fp64 run of (tolerance 1e-10); fp32 runs every column.
FP64_COLUMNS = ("fsdp2", "tensor_parallel", "pipeline", "context_parallel", "hybrid3d-pp2-tp2")


class SamplesData(L.LightningDataModule):
    """A compat task's samples (:mod:`benchmarks.compatibility.models`), ``batch_size`` per data-parallel rank.

    Args:
        task: The compat task (``causal``, ``masked``, ...).
        batch_size: Samples per batch per data-parallel rank.
    """

    def __init__(self, task: str, batch_size: int) -> None:
        super().__init__()
        self.task = task
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Samples(self.task), batch_size=self.batch_size, drop_last=True)


@dataclass(frozen=True)
class MatrixModel:
    """A row: its title, and what it says of the model (for the page)."""

    label: str
    title: str
    description: str
    why_fp32: str = ""


ROWS: dict[str, MatrixModel] = {
    row.label: row
    for row in (
        MatrixModel(
            "gpt", "example GPT", f"`examples/gpt.py` GPT ({GPT_LAYERS} layers, d_model 32) on `TextDataModule`"
        ),
        *(
            MatrixModel(name, TITLES[name], DESCRIPTIONS[name], MODELS[name].why_fp32)
            for name in ("llama", "gpt2", "bert", "litgpt")
        ),
    )
}


def build_module(label: str) -> L.LightningModule:
    """Row ``label``'s module. Build it once per matrix run and pass the same object to every check (verify's
    reference cache then trains each reference once)."""
    if label == "gpt":
        from examples.gpt import GPT

        L.seed_everything(SEED, verbose=False)
        return GPT(vocab_size=64, seq_len=32, d_model=32, n_layer=GPT_LAYERS, n_head=4)
    return CompatModule(label)  # AdamW at lr 1e-2, as in the compatibility matrix


def build_data(label: str, batch_replicas: int) -> L.LightningDataModule:
    """Row ``label``'s data for a column with ``batch_replicas`` data-parallel ranks (the same global batch)."""
    per_rank = GLOBAL_BATCH // batch_replicas
    if label == "gpt":
        from examples.data import TextDataModule

        return TextDataModule(seq_len=32, batch_size=per_rank, train_samples=64, val_samples=16)
    return SamplesData(MODELS[label].task, per_rank)
