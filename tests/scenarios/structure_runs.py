"""Model structures and idioms the strategies used to refuse or crash on, trained under tensor_parallel (and fsdp2
where sharding is concerned): gradient clipping by value, ``fc1``/``fc2`` beside a norm or an
``nn.MultiheadAttention`` in one block, Qwen3-style q/k norms over head_dim, and one ``nn.Linear`` shared by two blocks.

python tests/scenarios/structure_runs.py --devices 2 --out r.json --workdir DIR --scenarios norm_mlp_tp,...
python tests/scenarios/structure_runs.py --devices 1 --out ref.json --workdir DIR   # the one-process references
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from common import (  # type: ignore[import-not-found]
    StepRecorder,
    in_checkpoint_order,
    is_rank_zero,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from models import QKNormAttention  # type: ignore[import-not-found]
from torch import nn

from examples.gpt import GPT, CausalSelfAttention
from lightning_dist import FSDP2Strategy, TensorParallelStrategy

STEPS = 4
D_MODEL, HEADS = 32, 4


class NormMLPBlock(nn.Module):
    """fc1/fc2 directly in the block, beside its norms and attention."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.attn = CausalSelfAttention(D_MODEL, HEADS)
        self.fc1, self.fc2 = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class MultiheadAttentionBlock(nn.Module):
    """A hand-written block around ``nn.MultiheadAttention`` (left replicated) with fc1/fc2 (sharded)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.mha = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.mha(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class QKNormBlock(NormMLPBlock):
    def __init__(self) -> None:
        super().__init__()
        self.attn = QKNormAttention(D_MODEL, HEADS)  # Qwen3-style q/k norms over head_dim


BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "norm_mlp": NormMLPBlock,
    "mha": MultiheadAttentionBlock,
    "qk_norm": QKNormBlock,
}


def _model(devices: int, kind: str) -> tuple[GPT, L.LightningDataModule]:
    model, data = make_model_and_data(devices, dp_size=1 if devices > 1 else None, vocab_size=64, n_layer=2)
    torch.manual_seed(7)
    if kind == "shared_linear":
        model.blocks[1].mlp.up = model.blocks[0].mlp.up
    elif kind != "gpt":
        model.blocks = nn.ModuleList(BLOCKS[kind]() for _ in range(2))
    return model.double(), data


def train(devices: int, workdir: str, kind: str, strategy: str) -> dict[str, Any]:
    clip: dict[str, Any] = {"gradient_clip_val": 0.5}
    name = f"{kind}_{strategy}"
    if kind == "gpt_clip_by_value":  # Lightning's gradient_clip_algorithm="value": small enough to clamp
        kind, clip = "gpt", {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}
    model, data = _model(devices, kind)
    if devices == 1:
        chosen: Any = "auto"
    elif strategy == "tp":
        chosen = TensorParallelStrategy(tensor_parallel_size=devices)
    else:
        chosen = FSDP2Strategy()
        _, data = make_model_and_data(devices, vocab_size=64, n_layer=2)  # fsdp2: the batch is split over 2 ranks
    recorder = StepRecorder()
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=chosen, precision="64-true"),
        max_steps=STEPS,
        callbacks=[recorder],
        **clip,
    )
    trainer.fit(model, data)
    params = {n: in_checkpoint_order(model, n, p) for n, p in model.named_parameters()}  # fused rows restored
    if is_rank_zero():
        torch.save(params, f"{workdir}/{name}_d{devices}.pt")
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms}


CASES = [
    ("gpt_clip_by_value", "tp"),
    ("gpt_clip_by_value", "fsdp2"),
    ("norm_mlp", "tp"),
    ("mha", "tp"),
    ("qk_norm", "tp"),
    ("shared_linear", "tp"),
    ("shared_linear", "fsdp2"),
]
SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    f"{kind}_{strategy}": partial(train, kind=kind, strategy=strategy) for kind, strategy in CASES
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
