"""Expert parallelism's pure-PyTorch core in real processes (gloo, no Lightning): stock tiny transformers MoE models
(Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE) in fp64, their experts split over ep ranks, against one process.

Run as ``python tests/scenarios/expert_parallel_core_runs.py --devices 2 --out result.json``. Every rank builds the
model from one seed, computes the one-process reference on the whole batch itself, then applies expert parallelism
and runs its own half of the batch. Rank 0 writes ``{scenario: {...}}`` as JSON (errors are maxima over ranks).
"""

from __future__ import annotations

import copy
import sys
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from pure_torch import run_pure_torch_scenarios  # type: ignore[import-not-found]  (before lightning_dist: see there)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_dist.parallel.expert_parallel import apply_expert_parallel, take_expert_load
from lightning_dist.parallel.expert_parallel.module_list import SPLIT_OVER_EP

VOCAB, SEQ, BATCH = 64, 16, 4


def tiny_moe(kind: str = "mixtral", num_experts: int = 4, aux: bool = False) -> torch.nn.Module:
    """A stock tiny transformers MoE causal LM in fp64: Mixtral, Qwen3-MoE, Qwen2-MoE (with its shared expert,
    computed by the layer itself beside the experts) or OLMoE; 2 layers of ``num_experts`` experts, top-2."""
    import transformers

    common = {
        "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": SEQ, "attn_implementation": "eager",
        "experts_implementation": "eager", "num_experts_per_tok": 2, "eos_token_id": 1, "pad_token_id": 0,
        "bos_token_id": 0,
    }  # fmt: skip
    sparse = {
        "moe_intermediate_size": 24,
        "intermediate_size": 48,
        "num_experts": num_experts,
        "decoder_sparse_step": 1,
    }
    configs = {
        "mixtral": ("Mixtral", {"intermediate_size": 48, "num_local_experts": num_experts, "router_jitter_noise": 0.0}),
        "qwen3_moe": ("Qwen3Moe", {**sparse, "mlp_only_layers": []}),
        "qwen2_moe": ("Qwen2Moe", {**sparse, "mlp_only_layers": [], "shared_expert_intermediate_size": 40}),
        "olmoe": ("Olmoe", {"intermediate_size": 24, "num_experts": num_experts}),
        # shared experts and grouped routing (2 groups, the top group chosen first); MLA attention
        "deepseek_v3": ("DeepseekV3", {
            "intermediate_size": 48, "moe_intermediate_size": 24, "n_routed_experts": num_experts,
            "n_shared_experts": 1, "num_key_value_heads": 4, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 0, "q_lora_rank": None,
            "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        }),
        # expert biases, transposed weights with gate and up interleaved (its own gate), a router named "router"
        "gpt_oss": ("GptOss", {
            "intermediate_size": 24, "num_local_experts": num_experts, "head_dim": 8, "sliding_window": 8,
            "layer_types": ["full_attention", "sliding_attention"],
        }),
    }  # fmt: skip
    prefix, extra = configs[kind]
    if aux:  # the router's load-balancing loss, weighted 1 so that it shows in the loss
        extra = {**extra, "output_router_logits": True, "router_aux_loss_coef": 1.0}
    config = getattr(transformers, f"{prefix}Config")(**{**common, **extra})
    torch.manual_seed(1234)
    return getattr(transformers, f"{prefix}ForCausalLM")(config).double()


def tiny_litgpt_moe(shared_expert: bool = False) -> torch.nn.Module:
    """litgpt's ``GPT`` with ``LLaMAMoE`` layers (a ``ModuleList`` of 4 ``LLaMAMLP`` experts, top-2, routed in the
    same forward as the loop over them), optionally with a shared expert; 2 layers, fp64."""
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, n_query_groups=2,
        mlp_class_name="LLaMAMoE", moe_intermediate_size=24, n_expert=4, n_expert_per_token=2,
        n_shared_expert=1 if shared_expert else 0,
    )  # fmt: skip
    torch.manual_seed(1234)
    return GPT(config).double()


def _loss(model: torch.nn.Module, tokens: torch.Tensor, record: dict | None = None) -> torch.Tensor:
    """Next-token loss in the logits' dtype (transformers' own loss casts them to fp32, hiding fp64 parity), plus
    the router's auxiliary loss when the model returns one."""
    if not hasattr(model, "config") or not hasattr(model.config, "model_type"):  # litgpt: logits only
        logits = model(tokens)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    out = model(input_ids=tokens)
    logits = out.logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    if getattr(out, "aux_loss", None) is None:
        return loss
    if record is not None:
        record["aux"] = float(out.aux_loss.detach())
        home = sys.modules[type(model).__module__]  # what the model alone computes on this rank's tokens
        single = getattr(home.load_balancing_loss_func, "single_process", home.load_balancing_loss_func)
        config = model.config
        record["aux_this_rank_only"] = float(single(out.router_logits, model.num_experts, config.num_experts_per_tok))
    return loss + out.aux_loss.to(loss.dtype)


def _max_over_world(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _route_to_first_half(router: torch.nn.Module, args: Any, out: tuple) -> tuple:
    """A forward hook on a Mixtral router: every token goes to experts 0 and 1 only (those of ep rank 0)."""
    logits, scores, indices = out
    return logits, scores, indices % 2


def moe_fp64(
    rank: int,
    world: int,
    kind: str,
    aux: bool = False,
    ep: int | None = None,
    idle_rank: bool = False,
    chunks: int = 1,
) -> dict[str, Any]:
    """One forward and backward: the loss (mean over ranks) and every gradient against one process. ``ep`` smaller
    than the world: groups of ``ep`` ranks split the experts, the other ranks hold the same ones (replicas).
    ``idle_rank``: the routers send no token to the last ep rank's experts. ``chunks``: tokens dispatched in that
    many chunks, each chunk's all-to-all in flight while the experts compute another."""
    if kind == "user":
        from models import UserMoE  # type: ignore[import-not-found]  (imports Lightning: run after the others)

        torch.manual_seed(1234)
        model: torch.nn.Module = UserMoE().double()
    elif kind.startswith("litgpt"):
        model = tiny_litgpt_moe(kind == "litgpt_shared")
    else:
        model = tiny_moe(kind, aux=aux)
    if idle_rank:
        for layer in model.model.layers:
            layer.mlp.gate.register_forward_hook(_route_to_first_half)
    reference = copy.deepcopy(model)
    torch.manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    ref_aux: dict[str, float] = {}
    routed = _record_routing(reference) if kind == "mixtral" else {}
    ref_loss = _loss(reference, tokens, ref_aux)
    ref_loss.backward()

    ep = ep or world
    mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("ep_replicas", "ep"))
    batch = init_device_mesh("cpu", (world,), mesh_dim_names=("batch",))
    pattern = "layers.*.expert_list" if kind == "user" else None  # names no library uses: given by the user
    record = apply_expert_parallel(
        model, mesh["ep"], world, mesh["ep_replicas"], batch, pattern, dispatch_chunks=chunks
    )
    mine = tokens.chunk(world)[rank]
    aux_values: dict[str, float] = {}
    take_expert_load(model)  # counts start here
    loss = _loss(model, mine, aux_values)
    loss.backward()
    load = take_expert_load(model, batch.get_group())
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world

    grad_err, expert_grads, local_shapes = 0.0, 0, {}
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):  # an expert weight: its gradient is already the mean over the ep ranks
            grad = param.grad.full_tensor()
            expert_grads += 1
            local_shapes[name] = list(param.to_local().shape)
        elif hasattr(param, SPLIT_OVER_EP):  # a ModuleList expert this rank holds: already the mean, as above
            grad = param.grad
            expert_grads += 1
        else:  # replicated (dense) parameters: averaged over the data-parallel ranks, as DDP or FSDP would
            grad = param.grad.clone()
            dist.all_reduce(grad)
            grad /= world
        grad_err = max(grad_err, float((grad - ref_grads[name]).abs().max()))
    aux_result = {}
    if aux:
        per_rank_mean = torch.tensor([aux_values["aux_this_rank_only"]], dtype=torch.float64)
        dist.all_reduce(per_rank_mean)
        aux_result = {
            "aux_diff": _max_over_world(abs(aux_values["aux"] - ref_aux["aux"])),
            "aux": ref_aux["aux"],
            "per_rank_aux_mean_diff": abs(float(per_rank_mean) / world - ref_aux["aux"]),
        }
    return {
        **aux_result,
        "loss_diff": _max_over_world(abs(float(mean_loss) - float(ref_loss.detach()))),
        "grad_diff": _max_over_world(grad_err),
        "loss": float(ref_loss.detach()),
        "expert_parameters": expert_grads,
        "local_shapes": local_shapes,
        "record": record.describe(),
        "load": load,
        "load_reference": {name: _max_over_mean(ids, model.config) for name, ids in routed.items()},
    }


def _record_routing(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """The expert indices each Mixtral router returns, by its layer's experts module name (forward hooks)."""
    routed: dict[str, list[torch.Tensor]] = {}
    for i, layer in enumerate(model.model.layers):
        name = f"model.layers.{i}.mlp.experts"
        routed[name] = []
        layer.mlp.gate.register_forward_hook(lambda m, a, out, keep=routed[name]: keep.append(out[2].detach()))
    return routed


def _max_over_mean(indices: list[torch.Tensor], config: Any) -> float:
    counts = torch.bincount(torch.cat(indices).reshape(-1), minlength=config.num_local_experts)
    return float(counts.max() * counts.numel() / counts.sum())


SCENARIOS = {
    f"{kind}_fp64": partial(moe_fp64, kind=kind)
    for kind in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
}
SCENARIOS["mixtral_aux_fp64"] = partial(moe_fp64, kind="mixtral", aux=True)
SCENARIOS["mixtral_ep1_replicas_fp64"] = partial(moe_fp64, kind="mixtral", aux=True, ep=1)
SCENARIOS["mixtral_idle_rank_fp64"] = partial(moe_fp64, kind="mixtral", idle_rank=True)
SCENARIOS["user_fp64"] = partial(moe_fp64, kind="user")
SCENARIOS["mixtral_chunks3_fp64"] = partial(moe_fp64, kind="mixtral", chunks=3)
SCENARIOS["qwen2_moe_chunks2_fp64"] = partial(moe_fp64, kind="qwen2_moe", chunks=2)
SCENARIOS["mixtral_aux_chunks2_fp64"] = partial(moe_fp64, kind="mixtral", aux=True, chunks=2)
SCENARIOS["mixtral_idle_rank_chunks2_fp64"] = partial(moe_fp64, kind="mixtral", idle_rank=True, chunks=2)
SCENARIOS["litgpt_fp64"] = partial(moe_fp64, kind="litgpt")
SCENARIOS["litgpt_shared_fp64"] = partial(moe_fp64, kind="litgpt_shared")
SCENARIOS["litgpt_ep1_replicas_fp64"] = partial(moe_fp64, kind="litgpt", ep=1)


if __name__ == "__main__":
    run_pure_torch_scenarios(SCENARIOS, 2)
