"""Applying expert parallelism: each ep rank keeps ``E/ep`` experts of every mixture-of-experts layer and the
experts module's call becomes dispatch → local experts → combine. The model's router, its top-k choice, weight
normalization and any shared expert stay the model's own code; parameter names do not change.

Expert parameters become DTensors sharded on dim 0 (the expert dim) over the ep mesh, so a checkpoint holds them
with their global shape. Their gradients come back through the all-to-all summed over the ep ranks' tokens; they
are scaled by ``1 / gradient_divide_factor`` on the way (the data-parallel size) so that they are the mean over the
data-parallel ranks, as FSDP makes the other gradients. Ranks outside the ep group that hold the same experts
(``replicas``: dp_replicate × dp_shard·cp/ep) sum their gradients in the same backward, each micro-batch's as it is
computed, so accumulation needs nothing more. FSDP leaves these parameters alone (:func:`expert_parameters` are its
``ignored_params``), except where :mod:`.sharding` hands the experts to FSDP2 over those replicas instead
(``fsdp_shards_experts``): then FSDP2 shards them and averages their gradients there, and only the ``1/ep`` is
applied here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_dist.compat import is_fake_tensor
from lightning_dist.compat.hugging_face import apply_experts_gate, has_own_experts_gate
from lightning_dist.parallel.expert_parallel.dispatch import dispatch_compute_combine
from lightning_dist.parallel.expert_parallel.local_experts import StackedWeights, run_local_experts
from lightning_dist.parallel.expert_parallel.module_list import ModuleListExperts, apply_module_list
from lightning_dist.parallel.expert_parallel.router_loss import reduce_router_statistics
from lightning_dist.parallel.expert_parallel.state import ExpertGradient, ExpertParallelState, count_tokens
from lightning_dist.parallel.expert_parallel.structure import (
    STACKED_BIASES,
    ExpertLayer,
    ExpertParallelError,
    describe_dense,
    find_expert_layers,
)

# The experts layouts of transformers' @use_experts_implementation this module computes (attribute, supported value).
_SUPPORTED_LAYOUT = {"has_gate": True, "is_concatenated": True, "has_post_expert_norm": False}


@dataclass
class ExpertParallelRecord:
    """What :func:`apply_expert_parallel` did, for log lines and tests.

    Attributes:
        layers: Mixture-of-experts layers made expert-parallel.
        num_experts: Experts per layer (``E``); ``local_experts``: kept per rank (``E/ep``).
        ep: The ep group's size.
        parameters: Qualified names of the expert parameters sharded over ep.
        router_loss_modules: Modules whose auxiliary-loss function now reduces its statistics over the batch.
        sharded_over: The ranks FSDP2 shards the expert weights over (``ep_fsdp``; 1: whole on each rank).
        chunks: Token chunks per stacked-experts layer whose all-to-alls overlap the experts' work (1: none).
    """

    layers: int
    num_experts: int
    local_experts: int
    ep: int
    parameters: list[str]
    router_loss_modules: list[str] = field(default_factory=list)
    sharded_over: int = 1
    chunks: int = 1

    def describe(self) -> str:
        return (
            f"expert parallel: {self.layers} MoE layers, {self.num_experts} experts each, {self.local_experts} per"
            f" rank over ep={self.ep} (tokens sent to their experts by all-to-all)"
            + (f", their weights FSDP-sharded over ep_fsdp={self.sharded_over}" if self.sharded_over > 1 else "")
            + (f", tokens sent in {self.chunks} chunks overlapping the experts' work" if self.chunks > 1 else "")
            + ("; the router's auxiliary loss from the whole batch's routing" if self.router_loss_modules else "")
        )


def check_expert_parallel(model: nn.Module, ep: int, expert_modules: str | None = None) -> list[ExpertLayer]:
    """The model's expert layers (found from structure, or named by the ``expert_modules`` pattern, see
    :func:`find_expert_layers`), or :class:`ExpertParallelError` saying why ``ep`` cannot split them. No
    communication: run it before processes start."""
    layers = find_expert_layers(model, expert_modules)
    if not layers:
        raise ExpertParallelError(describe_dense(model))
    for layer in layers:
        unsupported = {
            a: getattr(layer.experts, a) for a, v in _SUPPORTED_LAYOUT.items() if getattr(layer.experts, a, v) != v
        }
        if unsupported.keys() == {"is_concatenated"} and has_own_experts_gate(layer.experts):
            unsupported = {}  # gate and up interleaved, split by the class's own _apply_gate (gpt-oss): computed
        if unsupported:
            raise ExpertParallelError(
                f"{layer.name} ({type(layer.experts).__name__}) has an experts layout expert parallelism does not"
                f" compute yet: {unsupported}. Use fsdp2 without expert_parallel_size for this model."
            )
        if layer.num_experts % ep:
            raise ExpertParallelError(
                f"expert_parallel_size={ep} does not divide the {layer.num_experts} experts of {layer.name}: every ep"
                f" rank must hold the same number of experts. Choose an expert_parallel_size that divides"
                f" {layer.num_experts} ({', '.join(str(d) for d in _divisors(layer.num_experts))})."
            )
    return layers


def apply_expert_parallel(
    model: nn.Module,
    ep_mesh: DeviceMesh,
    gradient_divide_factor: int | None = None,
    replicas: DeviceMesh | None = None,
    batch: DeviceMesh | None = None,
    expert_modules: str | None = None,
    fsdp_shards_experts: bool = False,
    dispatch_chunks: int = 1,
) -> ExpertParallelRecord:
    """Shard the experts of every MoE layer of ``model`` over the 1-D ``ep_mesh`` (in place; collective).

    Args:
        model: The unchanged model (transformers 5.x MoE); its expert weights must be equal on every ep rank.
        ep_mesh: The ranks that exchange tokens; rank ``r`` keeps experts ``r·E/ep … (r+1)·E/ep − 1``.
        gradient_divide_factor: The data-parallel size the expert gradients are averaged over (the ranks whose
            tokens reach an expert); default: the ep size, for ep ranks that are all the data-parallel ranks.
        replicas: The ranks holding the same experts as this one (other data, same ep position), whose expert
            gradients are summed; ``None`` or one rank: none.
        batch: The data-parallel ranks whose tokens make up the batch: the router's auxiliary loss
            (``output_router_logits=True``) is computed from their summed routing statistics (default: ``ep_mesh``).
        expert_modules: A pattern of the experts modules' qualified names, for experts not found from their
            structure (see :func:`find_expert_layers`).
        fsdp_shards_experts: FSDP2 will shard the expert weights over ``replicas`` and average their gradients there
            (:mod:`.sharding`): their gradients are only scaled by ``1/ep`` here.
        dispatch_chunks: Send each stacked-experts layer's tokens in that many chunks, so that each chunk's
            all-to-all overlaps the experts' work on another (1: one all-to-all each way, no overlap).
    """
    ep = ep_mesh.size()
    layers = check_expert_parallel(model, ep, expert_modules)
    divide = gradient_divide_factor or ep
    names: list[str] = []
    replica_group = replicas.get_group() if replicas is not None and replicas.size() > 1 else None
    # FSDP2 averages over the replicas itself when it shards the experts there: only the 1/ep is left here
    scale, copies = (1.0 / ep, None) if fsdp_shards_experts else (1.0 / divide, replica_group)
    for layer in layers:
        experts = layer.experts
        if layer.kind == "module_list":
            parent, _, attribute = layer.name.rpartition(".")
            kept = apply_module_list(
                model.get_submodule(parent), attribute, ep_mesh.get_local_rank(), ep, ep_mesh.get_group(), scale,
                copies,
            )  # fmt: skip
            names.extend(f"{parent}.{name}" if parent else name for name in kept)
            continue
        for pname, param in list(experts.named_parameters(recurse=False)):
            if param.shape[0] != layer.num_experts:
                raise ExpertParallelError(
                    f"{layer.name}.{pname} has shape {tuple(param.shape)}: no leading expert dim of"
                    f" {layer.num_experts}, so it cannot be split by expert."
                )
            sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            experts.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))
            names.append(f"{layer.name}.{pname}")
        experts.expert_parallel = ExpertParallelState(
            ep_mesh.get_group(), layer.num_experts, scale, copies, chunks=dispatch_chunks
        )
        experts.__class__ = _expert_parallel_class(type(experts))
    patched = reduce_router_statistics(model, (batch or ep_mesh).get_group())
    record = ExpertParallelRecord(len(layers), layers[0].num_experts, layers[0].num_experts // ep, ep, names, patched)
    record.chunks = dispatch_chunks if any(layer.kind == "stacked" for layer in layers) else 1
    return record


def expert_parallel_state(module: nn.Module) -> ExpertParallelState | ModuleListExperts | None:
    """The expert-parallel state :func:`apply_expert_parallel` left on ``module`` (an experts module, or the parent
    of a ``ModuleList`` of experts), or ``None``."""
    state = getattr(module, "expert_parallel", None)
    return state if isinstance(state, (ExpertParallelState, ModuleListExperts)) else None


def holds_some_experts(model: nn.Module) -> bool:
    """Whether ``model`` has ``ModuleList`` experts split over ep: its ranks then hold different parameters (each
    its own experts, under their global names), as pipeline stages do, and checkpoints must merge them."""
    return any(isinstance(getattr(m, "expert_parallel", None), ModuleListExperts) for m in model.modules())


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters :func:`apply_expert_parallel` sharded over ep (FSDP must leave them alone)."""
    out = []
    for module in model.modules():
        state = getattr(module, "expert_parallel", None)
        if isinstance(state, ExpertParallelState):
            out.extend(module.parameters(recurse=False))
        elif isinstance(state, ModuleListExperts):
            out.extend(state.parameters())
    return out


def _local(module: nn.Module, name: str, state: ExpertParallelState, dtype: torch.dtype) -> torch.Tensor | None:
    param = getattr(module, name, None)
    if param is None:
        return None
    local = param.to_local() if isinstance(param, DTensor) else param
    # FSDP's mixed precision does not reach these parameters: compute in the activations' dtype, as it would.
    return ExpertGradient.apply(local, state.grad_scale, state.replica_group).to(dtype)


def _expert_parallel_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor | None = None,
    top_k_weights: torch.Tensor | None = None,
    **named: torch.Tensor,
) -> torch.Tensor:
    # gpt-oss passes them by keyword, under its own names
    top_k_index = named.pop("router_indices", top_k_index)
    top_k_weights = named.pop("routing_weights", top_k_weights)
    if named or top_k_index is None or top_k_weights is None:
        raise ExpertParallelError(
            f"{type(self).__name__} was called with arguments expert parallelism does not know: {sorted(named)}"
            " (expected hidden states, the top-k expert indices and their weights)."
        )
    state: ExpertParallelState = self.expert_parallel
    if not is_fake_tensor(top_k_index):  # a dry run's routing has no values to count
        count_tokens(state, torch.bincount(top_k_index.reshape(-1), minlength=state.num_experts))
    dtype = hidden_states.dtype
    weights = StackedWeights(
        gate_up=_local(self, "gate_up_proj", state, dtype),
        down=_local(self, "down_proj", state, dtype),
        gate_up_bias=_local(self, STACKED_BIASES[0], state, dtype),
        down_bias=_local(self, STACKED_BIASES[1], state, dtype),
        transposed=bool(getattr(self, "is_transposed", False)),
    )
    return dispatch_compute_combine(
        hidden_states, top_k_index, top_k_weights, state.num_experts, state.group,
        lambda rows, counts: run_local_experts(rows, counts, weights, lambda h: apply_experts_gate(self, h)),
        state.chunks,
    )  # fmt: skip


_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    """A subclass of the experts class whose ``forward`` is the expert-parallel one (the class keeps its name's
    module path so ``repr`` and checkpoints are unaffected; parameter names are the same)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (cls,), {"forward": _expert_parallel_forward})
    return _CLASSES[cls]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
