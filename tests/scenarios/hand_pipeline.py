"""A hand-written 2-rank pipeline over the step protocol (not the pipeline strategy): the example GPT cut into four
stages in place, two per rank (rank r holds stages r and r + 2, as an interleaved schedule places them), run with
plain send/recv through ``run_training_step`` and ``run_backward``.

It checks what the base does for a rank that holds several model parts and only its stages' parameters: the
optimizer sees the local parameters, clipping uses the norm over both stages, logged values come from the loss stage,
a sharded checkpoint saves and loads strictly (keys checked over both stages), and a full-state save gathers every
stage into one file.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize

# The four stages, each a list of the GPT's module names, in forward order.
STAGES = [["tok_emb", "pos_emb", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "ln_f", "head"]]


class HandPipeline(MeshParallelStrategy):
    """pp=2: this rank runs stages ``rank`` and ``rank + 2``; activations and their gradients travel by send/recv."""

    log_name = "hand_pipeline"

    def mesh_sizes(self) -> dict[str, MeshSize]:
        return {"pp": 2}

    def parallelize(self, model: nn.Module) -> nn.Module:
        rank = dist.get_rank(self.process_group("pp"))
        self._local = [s for s in range(len(STAGES)) if s % 2 == rank]
        for stage, names in enumerate(STAGES):
            if stage not in self._local:
                for name in names:  # cut in place: the parameters of other stages leave the LightningModule
                    parent, _, child = name.rpartition(".")
                    setattr(model.get_submodule(parent) if parent else model, child, nn.Identity())
        self.model_parts = [nn.ModuleList(model.get_submodule(n) for n in STAGES[s]) for s in self._local]
        return model

    # ------------------------------------------------------------------ the schedule: one forward, one backward
    def _run_stage(self, stage: int, x: Tensor, batch: dict[str, Tensor]) -> Tensor:
        model = self.lightning_module
        if stage == 0:
            ids = batch["input_ids"]
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            x = model.tok_emb(ids) + model.pos_emb(positions)
            names = STAGES[0][2:]
        else:
            names = STAGES[stage]
        for name in names:
            x = model.get_submodule(name)(x)
        return x

    def run_training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        model, group = self.lightning_module, self.process_group("pp")
        peer = 1 - dist.get_rank(group)
        shape = (*batch["input_ids"].shape, model.hparams.d_model)
        self._saved: list[tuple[int, Tensor | None, Tensor]] = []  # (stage, its input, its output) per local stage
        x: Tensor | None = None
        for stage in self._local:
            if stage > 0:
                x = torch.empty(shape, dtype=torch.float64)
                dist.recv(x, group=group, group_src=peer)
                x.requires_grad_()
            out = self._run_stage(stage, x, batch)
            self._saved.append((stage, x, out))
            if stage < len(STAGES) - 1:
                dist.send(out.detach().contiguous(), group=group, group_dst=peer)
        is_last = self._local[-1] == len(STAGES) - 1
        logits = self._saved[-1][2] if is_last else torch.zeros(*batch["input_ids"].shape, model.hparams.vocab_size)
        model.forward = lambda *args, **kwargs: logits  # the user's training_step, on this stage's output
        try:
            loss = model.training_step(batch, batch_idx)
        finally:
            del model.forward
        shared = self.from_loss_stage(loss)  # every rank returns (and reports) the loss stage's value
        return loss if is_last else shared

    def run_backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        group = self.process_group("pp")
        peer = 1 - dist.get_rank(group)
        for stage, x, out in reversed(self._saved):
            if stage == len(STAGES) - 1:  # the loss's backward, as Lightning runs it (precision, hooks)
                super().run_backward(closure_loss, optimizer, *args, **kwargs)
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, group=group, group_src=peer)
                out.backward(grad)
            if x is not None:
                dist.send(x.grad.contiguous(), group=group, group_dst=peer)
        self._saved = []
        return closure_loss
