"""Modules with planted mistakes for the dry run to find: a rank-dependent branch, a read across pipeline stages."""

from __future__ import annotations

import torch
import torch.distributed as dist

from examples.gpt import GPT


class RankBranchGPT(GPT):
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.tok_emb(input_ids) + self.pos_emb(position_ids)
        if dist.get_rank() % 2 == 1:  # another branch on some ranks: one more all-gather of the first block
            x = self.blocks[0](x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class CrossStageGPT(GPT):
    """The example GPT whose head also reads the token embedding's weight (another stage's module under pp)."""

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(input_ids, position_ids)
        return logits + self.ln_f(self.tok_emb.weight).sum()
