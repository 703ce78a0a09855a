"""Expert parallelism for unchanged mixture-of-experts models, pure PyTorch (no Lightning import).

Each rank of the ep mesh keeps ``E/ep`` experts of every MoE layer; tokens travel to their experts by all-to-all
and back. Routing stays the model's own code. Which file holds what:

- :mod:`.structure` — recognizing MoE layers from structure (:func:`find_expert_layers`), the dense-model message.
- :mod:`.dispatch` — token permutation by expert, the uneven differentiable all-to-all, combine; token chunks whose
  all-to-alls overlap the experts' work.
- :mod:`.local_experts` — the local experts' computation (per-expert loop; grouped GEMM on CUDA bf16).
- :mod:`.apply` — :func:`check_expert_parallel` (before launch), :func:`apply_expert_parallel` (shard the experts
  as DTensors over ep, swap the experts' call), :func:`expert_parameters`, :func:`holds_some_experts`.
- :mod:`.sharding` — the experts as FSDP2 units over the ranks ep leaves (``ep_fsdp``), where there are any.
- :mod:`.module_list` — ``ModuleList`` experts routed inside their layer's forward (litgpt ``LLaMAMoE``): record,
  exchange, replay.
- :mod:`.load` — per-layer expert load (max / mean tokens per expert), counted in the forward.
- :mod:`.state` — what an expert-parallel layer keeps at call time (both kinds), its token counts and the scaling
  of its gradients.
- :mod:`.router_loss` — the router's auxiliary loss from the routing statistics of the whole batch.
"""

from lightning_dist.parallel.expert_parallel.apply import (
    ExpertParallelRecord,
    apply_expert_parallel,
    check_expert_parallel,
    expert_parameters,
    holds_some_experts,
)
from lightning_dist.parallel.expert_parallel.dispatch import all_to_all, combine, dispatch
from lightning_dist.parallel.expert_parallel.load import take_expert_load
from lightning_dist.parallel.expert_parallel.module_list import mark_held_experts
from lightning_dist.parallel.expert_parallel.structure import ExpertLayer, ExpertParallelError, find_expert_layers

__all__ = [
    "ExpertLayer",
    "ExpertParallelError",
    "ExpertParallelRecord",
    "all_to_all",
    "apply_expert_parallel",
    "check_expert_parallel",
    "combine",
    "dispatch",
    "expert_parameters",
    "find_expert_layers",
    "holds_some_experts",
    "mark_held_experts",
    "take_expert_load",
]
