"""FSDP2 over the ranks ep leaves: expert weights sharded over ``ep_fsdp`` (dp_shard·cp/ep) as well as split over ep.

Expert parallelism borrows ep of the dp_shard·cp ranks; the other dp_shard·cp/ep ranks (``ep_fsdp``) see other
tokens for the same experts. Left replicated there, every rank would hold ``E/ep`` whole experts: ``fsdp/ep`` times
what it holds of a dense weight. Instead each layer's stacked experts module (transformers: weights already DTensors
``Shard(0)``, by expert, on ``mesh["ep"]``) becomes an FSDP2 unit of its own over ``mesh.experts_data_parallel``.
FSDP2 joins the two meshes into one 2-D (3-D with HSDP's replicate dim) DTensor of each weight's global shape,
gathers each rank's ``E/ep`` experts before the experts' call and reduce-scatters their gradients over ep_fsdp after
it. Each expert a rank holds of a ``ModuleList`` (litgpt) becomes a unit too, a plain FSDP2 module over ep_fsdp under
its global name.

FSDP shards a dim other than the expert dim (the first that ep_fsdp divides): sharding dim 0 again would need
FSDP2's strided placement over ep's, which checkpoint resharding handles less simply.

Gradients: each expert's gradient sums the contributions of the ep ranks' tokens and is scaled by ``1/ep`` on the
way; FSDP2 averages over its mesh (ep_fsdp, and dp_replicate under HSDP). Together that is the mean over the whole
data-parallel group, as for the dense weights.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Shard

from lightning_dist.parallel.expert_parallel.module_list import ModuleListExperts
from lightning_dist.parallel.expert_parallel.state import ExpertParallelState


def stacked_experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules :func:`~.apply.apply_expert_parallel` split over ep whose weights are stacked by expert
    (transformers 5.x): each becomes one FSDP2 unit over ep_fsdp."""
    return [m for m in model.modules() if isinstance(getattr(m, "expert_parallel", None), ExpertParallelState)]


def held_expert_modules(model: nn.Module) -> list[nn.Module]:
    """The experts this rank holds of every ``ModuleList`` MoE layer (litgpt): each becomes one FSDP2 unit over
    ep_fsdp (its weights sharded on dim 0, as FSDP2 shards any weight), called as a module by the layer's exchange."""
    return [
        expert
        for m in model.modules()
        if isinstance(state := getattr(m, "expert_parallel", None), ModuleListExperts)
        for _, expert in sorted(state.local.items())
    ]


def expert_shard_placement(shards: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP2's ``shard_placement_fn`` for stacked expert weights over ``shards`` ranks: the first dim after the
    expert dim that ``shards`` divides (FSDP2 shards dims other than 0 only evenly); dim 0 when none does."""

    def placement(param: nn.Parameter) -> Shard:
        for dim in range(1, param.ndim):
            if param.shape[dim] % shards == 0:
                return Shard(dim)
        return Shard(0)

    return placement
