"""A planted hang for the dry run to find: the example GPT, except that odd ranks run the first block twice."""

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
