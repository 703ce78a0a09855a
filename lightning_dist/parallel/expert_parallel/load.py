"""Per-layer expert load: how evenly each MoE layer's router spreads tokens over its experts.

The expert-parallel forward counts, for every MoE layer, the tokens this rank routes to each expert (``top_k``
assignments per token); :func:`take_expert_load` sums the counts over the data-parallel ranks and gives, per layer,
``max / mean`` tokens per expert: 1.0 is perfectly balanced, ``E / top_k`` means every token went to the same
experts (routing collapse). The ratio does not depend on how many forwards were counted, so a forward recomputed by
activation checkpointing changes nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.parallel.expert_parallel.apply import expert_parallel_state


def take_expert_load(model: nn.Module, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """``max / mean`` tokens per expert of every MoE layer of ``model`` since the last call (counts summed over
    ``group``, the data-parallel ranks), by the experts module's name; the counts start again from zero. Layers
    that routed nothing are left out. Collective over ``group`` (every rank must call it, with the same layers)."""
    loads = {}
    for name, module in model.named_modules():
        state = expert_parallel_state(module)
        if state is None:
            continue
        counts = state.load if state.load is not None else torch.zeros(state.num_experts, dtype=torch.int64)
        state.load = None
        if group is not None and dist.get_world_size(group) > 1:
            if dist.get_backend(group) == "nccl" and not counts.is_cuda:
                counts = counts.cuda()
            dist.all_reduce(counts, group=group)
        total = counts.sum()
        if total > 0:
            loads[name] = float(counts.max() * counts.numel() / total)
    return loads
