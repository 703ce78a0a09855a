"""Expert parallelism: MoE layers recognized from structure, and a stock tiny Mixtral whose experts are split over
ep ranks matching one process (real processes over gloo)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launch import FULL_MATRIX, run_scenarios

from lightning_dist.parallel.expert_parallel import ExpertParallelError, check_expert_parallel, find_expert_layers

FP64_TOL = 1e-10


def _mixtral(num_experts: int = 4) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=num_experts, num_experts_per_tok=2, max_position_embeddings=16,
    )  # fmt: skip
    return MixtralForCausalLM(config)


def test_transformers_experts_are_found_with_their_router():
    layers = find_expert_layers(_mixtral())
    assert [(x.name, x.router, x.num_experts, x.kind) for x in layers] == [
        (f"model.layers.{i}.mlp.experts", f"model.layers.{i}.mlp.gate", 4, "stacked") for i in range(2)
    ]


def test_litgpt_module_list_experts_are_found_with_their_router():
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=1, n_head=4, n_embd=32, mlp_class_name="LLaMAMoE",
        moe_intermediate_size=48, n_expert=4, n_expert_per_token=2,
    )  # fmt: skip
    layers = find_expert_layers(GPT(config))
    assert [(x.name, x.router, x.num_experts, x.kind) for x in layers] == [
        ("transformer.h.0.mlp.experts", "transformer.h.0.mlp.gate", 4, "module_list")
    ]
    assert [x.name for x in check_expert_parallel(GPT(config), 2)] == ["transformer.h.0.mlp.experts"]


def test_a_dense_model_is_refused_saying_what_was_looked_for():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1))
    with pytest.raises(ExpertParallelError, match=r"LlamaForCausalLM has no mixture-of-experts layer.*gate_up_proj"):
        check_expert_parallel(model, 2)


def test_experts_not_divisible_by_ep_are_refused_with_the_divisors():
    with pytest.raises(ExpertParallelError, match=r"expert_parallel_size=4 does not divide the 6 experts.*1, 2, 3, 6"):
        check_expert_parallel(_mixtral(num_experts=6), 4)


@pytest.fixture(scope="module")
def core_runs(tmp_path_factory) -> dict[str, Any]:
    scenarios = [*MOE_KINDS, "mixtral_aux_fp64", "mixtral_ep1_replicas_fp64", "mixtral_idle_rank_fp64", *CHUNKED]
    # last: litgpt's model (and the shared models module) import Lightning, which the scenarios before must not need
    scenarios += [*LITGPT_KINDS, "user_fp64"]
    return run_scenarios("expert_parallel_core_runs.py", 2, tmp_path_factory.mktemp("ep_core"), scenarios)


# scenario: expert parameters (3-D weights, and gpt-oss's expert biases) over the 2 layers
MOE_KINDS = {
    "mixtral_fp64": 4, "qwen3_moe_fp64": 4, "qwen2_moe_fp64": 4, "olmoe_fp64": 4, "deepseek_v3_fp64": 4,
    "gpt_oss_fp64": 8,
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_experts_split_over_two_ranks_match_one_process_in_fp64(core_runs, kind):
    """Each rank keeps 2 of 4 experts per layer; tokens reach them by all-to-all; loss and every gradient (dense
    ones averaged over the ranks, expert ones gathered) equal one process's. Qwen2-MoE's shared expert and
    OLMoE's / Qwen3-MoE's routing stay the model's own code, as do DeepSeek-V3's shared experts and grouped routing
    and gpt-oss's expert biases, transposed weights and interleaved gate/up (its own gate function). (DeepSeek-V3's
    router computes in fp32 whatever the model's dtype: its gradients differ by up to 6e-11, still within 1e-10.)"""
    run = core_runs[kind]
    assert run["loss_diff"] <= FP64_TOL and run["grad_diff"] <= FP64_TOL, run
    assert run["expert_parameters"] == MOE_KINDS[kind]
    assert all(shape[0] == 2 for shape in run["local_shapes"].values()), run["local_shapes"]
    assert core_runs.get("lightning_imported_by") == LITGPT_KINDS[0], "the library imported Lightning"


# dispatch_chunks > 1: Mixtral in 3 chunks, and in 2 with the auxiliary loss; Qwen2-MoE (shared expert) in 2; 2 chunks
# with the last rank's experts getting no token
CHUNKED = [
    "mixtral_chunks3_fp64",
    "mixtral_aux_chunks2_fp64",
    "qwen2_moe_chunks2_fp64",
    "mixtral_idle_rank_chunks2_fp64",
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", CHUNKED)
def test_tokens_sent_in_chunks_overlapping_the_experts_match_one_process_in_fp64(core_runs, kind):
    """With dispatch_chunks, every chunk's rows are sent at once (functional all-to-alls left in flight) and the
    experts compute each chunk as it arrives while the next travel, in forward and backward: loss and every
    gradient equal one process's."""
    run = core_runs[kind]
    assert run["loss_diff"] <= FP64_TOL and run["grad_diff"] <= FP64_TOL, run
    if "aux" in run:
        assert run["aux_diff"] <= FP64_TOL, run


LITGPT_KINDS = ["litgpt_fp64", "litgpt_shared_fp64", "litgpt_ep1_replicas_fp64"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", LITGPT_KINDS)
def test_litgpt_module_list_experts_split_over_two_ranks_match_one_process_in_fp64(core_runs, kind):
    """litgpt's LLaMAMoE keeps its experts in a ModuleList and loops over them in the same forward as its routing:
    each rank keeps 2 of the 4 experts (``_shared``: beside litgpt's shared expert; ``_ep1_replicas``: all 4, the
    other rank a replica), the layer's forward is recorded, its expert calls exchanged by all-to-all, and replayed.
    Loss and every gradient equal one process's."""
    run = core_runs[kind]
    assert run["loss_diff"] <= FP64_TOL and run["grad_diff"] <= FP64_TOL, run
    per_rank = 4 if "ep1" in kind else 2
    # 2 layers × experts held × the weights and biases of fc_1, fc_2, proj (litgpt's Config has bias=True)
    assert run["expert_parameters"] == 2 * per_rank * 6, run


@pytest.mark.slow
def test_expert_load_is_counted_over_the_whole_batch(core_runs):
    """The load each ep rank counts in its forward, summed over the ranks, is what one process's routers chose on
    the whole batch: max / mean tokens per expert per layer, exactly."""
    run = core_runs["mixtral_fp64"]
    assert set(run["load"]) == {f"model.layers.{i}.mlp.experts" for i in range(2)}
    assert run["load"] == run["load_reference"], run
    assert all(1.0 <= value <= 4 / 2 for value in run["load"].values())  # balanced … all on top_k of E experts


@pytest.mark.slow
def test_the_router_auxiliary_loss_is_the_one_process_value_over_the_whole_batch(core_runs):
    """output_router_logits=True, weight 1: the load-balancing loss comes from the routing statistics summed over
    the ranks, so it is one process's value (per-rank values averaged would be 1e-3 off), and so are the loss and
    every gradient. (transformers computes this loss in fp32: hence 1e-6 on its value.)"""
    run = core_runs["mixtral_aux_fp64"]
    assert run["aux_diff"] <= 1e-6 and run["per_rank_aux_mean_diff"] > 1e-4, run
    assert run["loss_diff"] <= FP64_TOL and run["grad_diff"] <= FP64_TOL, run


@pytest.mark.slow
def test_ranks_holding_the_same_experts_sum_their_gradients(core_runs):
    """ep=1 on 2 ranks: each rank holds all 4 experts and the other rank is its replica (as when ep < dp_shard ×
    cp); the expert gradients are summed over the replicas in backward, the auxiliary loss still sees the batch."""
    run = core_runs["mixtral_ep1_replicas_fp64"]
    assert all(shape[0] == 4 for shape in run["local_shapes"].values()), run["local_shapes"]
    assert run["loss_diff"] <= FP64_TOL and run["grad_diff"] <= FP64_TOL and run["aux_diff"] <= 1e-6, run


@pytest.mark.slow
def test_a_rank_whose_experts_get_no_token_still_joins_the_backward_all_to_all(core_runs):
    """The routers send every token to experts 0 and 1 (rank 0's): rank 1 computes nothing, but its empty result
    must still reach the dispatch all-to-all in backward, or rank 0 waits there forever. Loss and gradients (zero
    for the idle experts) equal one process's."""
    run = core_runs["mixtral_idle_rank_fp64"]
    assert run["loss_diff"] <= FP64_TOL and run["grad_diff"] <= FP64_TOL, run


def test_experts_under_names_no_library_uses_are_refused_pointing_to_expert_modules():
    """A user's MoE (experts in a ModuleList called expert_list, routed by scorer) is not found from its structure:
    the message says what was looked for and names the option; a pattern that matches nothing says what it
    matched and lists the model's ModuleLists; the right pattern finds both layers."""
    from tests.scenarios.models import UserMoE

    model = UserMoE()
    with pytest.raises(
        ExpertParallelError, match=r"UserMoE has no mixture-of-experts layer.*name them with expert_modules"
    ):
        check_expert_parallel(model, 2)
    with pytest.raises(ExpertParallelError, match=r"expert_modules='layers\.\*\.experts' names no experts module: it"
                       r" matches no module name\. The model's ModuleLists of more than one module: layers, "
                       r"layers\.0\.expert_list"):  # fmt: skip
        check_expert_parallel(model, 2, "layers.*.experts")
    layers = check_expert_parallel(model, 2, "layers.*.expert_list")
    assert [(x.name, x.num_experts, x.kind) for x in layers] == [
        (f"layers.{i}.expert_list", 4, "module_list") for i in range(2)
    ]


@pytest.mark.slow
def test_experts_named_by_expert_modules_split_over_two_ranks_match_one_process(core_runs):
    """The same user model with expert_modules='layers.*.expert_list': its own forward routes, the experts are split
    over 2 ranks; loss and every gradient equal one process's (fp64)."""
    run = core_runs["user_fp64"]
    assert run["loss_diff"] <= FP64_TOL and run["grad_diff"] <= FP64_TOL, run
    assert run["expert_parameters"] == 2 * 2 * 4, run  # 2 layers × 2 experts held × 2 Linear (weight, bias)


# ---------------------------------------------------------------------------------------------------- the strategy
SCRIPT = "expert_parallel_runs.py"
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Any]:
    # the pipeline's auxiliary-loss test compares with qwen3_moe_aux_fp64 whichever Trainer pairings run
    references = dict.fromkeys([*TRAINER_MODELS, "qwen3_moe_aux_fp64"])
    scenarios = ["fp64", "fp32", "litgpt_fp64", *references, "half_batches_qwen3_moe_aux_fp64"]
    return run_scenarios(SCRIPT, 1, tmp_path_factory.mktemp("ep_reference"), scenarios)


@pytest.fixture(scope="module")
def ep_two_ranks(tmp_path_factory) -> dict[str, Any]:
    scenarios = [
        "ep_fp64", "resume_ep_to_fsdp2", "resume_fsdp2_to_ep", "ep_fp32", "bytes_fsdp2", "bytes_ep", "pipeline_fp32",
        "ep_litgpt_fp64", "resume_litgpt_ep_to_fsdp2", "zeropp_ep_fp32", "litgpt_empty_init",
        "pp2_microbatches2_qwen3_moe_aux_fp64",
    ]  # fmt: skip
    scenarios += [f"ep_{name}" for name in TRAINER_MODELS]
    return run_scenarios(SCRIPT, 2, tmp_path_factory.mktemp("ep_strategy"), scenarios)


# Qwen3-MoE without and Qwen2-MoE (its shared expert beside the routed ones) with the router's auxiliary loss; the other
# two only under LIGHTNING_DIST_FULL_MATRIX=1 (tests/launch.py; benchmarks/verify/moe.py runs all four on every mesh).
TRAINER_MODELS = [f"{kind}{aux}_fp64" for kind in ("qwen3_moe", "qwen2_moe") for aux in ("", "_aux")]
if not FULL_MATRIX:
    TRAINER_MODELS = ["qwen3_moe_fp64", "qwen2_moe_aux_fp64"]
# The recorded loss of a micro-batch is divided by the 2 accumulated; the _aux runs' router_aux_loss_coef is 0.5.
AUX_WEIGHT = 0.5 / 2


def _assert_trains_like(ref: dict[str, Any], run: dict[str, Any]) -> None:
    """Losses, gradient norms and final parameters within fp64's tolerance of one process's, and the copies of
    every parameter on different ranks equal."""
    assert max(abs(a - b) for a, b in zip(ref["losses"], run["losses"])) <= FP64_TOL
    assert max(abs(a - b) for a, b in zip(ref["grad_norms"], run["grad_norms"])) <= FP64_TOL
    assert _max_param_diff(ref["params"], run["params"]) <= FP64_TOL and run["copies_gap"] == 0.0


def _max_param_diff(a: dict[str, list], b: dict[str, list]) -> float:
    assert a.keys() == b.keys()
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "tol"), [("fp64", FP64_TOL), ("fp32", FP32_TOL)])
def test_fsdp2_with_ep2_trains_mixtral_like_one_process(one_process, ep_two_ranks, dtype, tol):
    """4 optimizer steps of 2 accumulated micro-batches with clipping: losses, gradient norms and the final
    parameters (expert weights gathered from their ep shards) equal one process's."""
    ref, run = one_process[dtype], ep_two_ranks[f"ep_{dtype}"]
    assert len(run["losses"]) == len(ref["losses"]) == 8
    assert max(abs(a - b) for a, b in zip(ref["losses"], run["losses"])) <= tol
    assert max(abs(a - b) for a, b in zip(ref["grad_norms"], run["grad_norms"])) <= tol
    assert _max_param_diff(ref["params"], run["params"]) <= tol


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINER_MODELS)
def test_fsdp2_with_ep2_trains_qwen_moe_models_like_one_process(one_process, ep_two_ranks, name):
    """Stock tiny Qwen3-MoE and Qwen2-MoE (shared expert) under fsdp2 ep=2, 2 steps × 2 micro-batches with
    clipping; ``_aux``: output_router_logits=True, the auxiliary loss added with router_aux_loss_coef=0.5 (its
    routing statistics summed over the batch). Losses, gradient norms and final parameters equal one process's.
    transformers computes the auxiliary loss in fp32 even in fp64 (in one process too), so the ranks' summed
    statistics may round it 1 fp32 ulp apart: the loss is compared without it, and it alone to fp32 precision."""
    ref, run = one_process[name], ep_two_ranks[f"ep_{name}"]
    assert len(run["losses"]) == len(ref["losses"]) == 4 and len(run["aux"]) == len(ref["aux"])
    assert bool(ref["aux"]) == name.endswith("_aux_fp64")
    assert max([abs(a - b) for a, b in zip(ref["aux"], run["aux"])], default=0.0) <= 1e-6

    def without_aux(losses: list[float], aux: list[float]) -> list[float]:
        return [loss - AUX_WEIGHT * a for loss, a in zip(losses, aux or [0.0] * len(losses))]

    ref_losses, run_losses = without_aux(ref["losses"], ref["aux"]), without_aux(run["losses"], run["aux"])
    assert max(abs(a - b) for a, b in zip(ref_losses, run_losses)) <= FP64_TOL
    assert max(abs(a - b) for a, b in zip(ref["grad_norms"], run["grad_norms"])) <= FP64_TOL
    assert _max_param_diff(ref["params"], run["params"]) <= FP64_TOL


@pytest.mark.slow
def test_experts_are_split_not_gathered_and_all_to_all_carries_the_tokens(ep_two_ranks):
    """At ep = dp_shard = 2 a step all-gathers at most half of what plain fsdp2 does (experts are ~80% of the
    parameters), and each layer's all-to-all sends about tokens × top_k × hidden × 4 bytes × (ep−1)/ep per
    direction (the exact value depends on where the router sends the tokens)."""
    plain, ep = ep_two_ranks["bytes_fsdp2"]["bytes"], ep_two_ranks["bytes_ep"]
    assert ep["bytes"]["all_gather"] <= 0.5 * plain["all_gather"], (ep["bytes"], plain)
    assert plain["all_to_all_forward"] == 0
    assert ep["expert_local_shapes"] == ["(2, 32, 48)", "(2, 96, 32)"]  # 2 of 4 experts per rank
    layers, directions = 2, 2
    assert ep["bytes"]["all_to_all_count"] == layers * 3 + layers * 2  # counts + dispatch + combine; 2 in backward
    formula = ep["local_tokens"] * 2 * 32 * 4 * (2 - 1) / 2
    per_direction = ep["bytes"]["all_to_all_backward"] / (layers * directions)
    assert 0.5 * formula <= per_direction <= 1.5 * formula, (per_direction, formula)


@pytest.mark.slow
def test_fp32_mixtral_with_its_grouped_mm_experts_trains_under_the_pipeline(one_process, ep_two_ranks):
    """transformers' default experts kernel (grouped_mm) has a meta kernel that takes bf16 only; the pipeline's
    shape inference ran earlier stages on meta and crashed on rank 1. Experts now compute shapes only on meta."""
    ref, run = one_process["fp32"], ep_two_ranks["pipeline_fp32"]
    assert len(run["losses"]) == len(ref["losses"]) == 8
    assert max(abs(a - b) for a, b in zip(ref["losses"], run["losses"])) <= FP32_TOL
    assert max(abs(a - b) for a, b in zip(ref["grad_norms"], run["grad_norms"])) <= FP32_TOL


@pytest.mark.slow
def test_a_checkpoint_saved_under_ep2_resumes_under_plain_fsdp2(ep_two_ranks):
    """Expert weights and their optimizer state are saved as DCP with their global shape: plain fsdp2 (experts
    sharded by FSDP, no ep) resumes the step-2 checkpoint of the ep=2 run and continues to its losses."""
    uninterrupted, resumed = ep_two_ranks["ep_fp64"]["losses"], ep_two_ranks["resume_ep_to_fsdp2"]["losses"]
    assert len(resumed) == 4
    assert max(abs(a - b) for a, b in zip(uninterrupted[4:], resumed)) <= FP64_TOL, (uninterrupted, resumed)


@pytest.mark.slow
def test_a_plain_fsdp2_checkpoint_resumes_under_ep2(ep_two_ranks):
    """The other way: plain fsdp2 (expert_parallel_size=1, experts FSDP-sharded) trains 2 steps and checkpoints;
    ep=2 resumes it (experts re-split over ep from their global shape) and continues to the uninterrupted ep=2 run's
    losses (which are one process's)."""
    uninterrupted, run = ep_two_ranks["ep_fp64"]["losses"], ep_two_ranks["resume_fsdp2_to_ep"]
    assert len(run["first_losses"]) == len(run["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(uninterrupted, run["first_losses"] + run["losses"])) <= FP64_TOL, run


@pytest.mark.slow
def test_a_consolidated_ep2_checkpoint_loads_into_the_stock_model_with_its_logits(ep_two_ranks):
    """`lightning-dist consolidate` of the ep=2 run's last checkpoint gives a state dict the stock
    MixtralForCausalLM loads with strict=True (the experts' 3-D weights whole), whose logits are the run's model's."""
    export = ep_two_ranks["ep_fp64"]["export"]
    assert export["tensors"] == len(_mixtral().state_dict()), export
    assert export["logits_diff"] <= FP64_TOL, export


@pytest.mark.slow
def test_litgpt_moe_under_ep2_trains_like_one_process_and_resumes_under_plain_fsdp2(one_process, ep_two_ranks):
    """litgpt's LLaMAMoE (a ModuleList of experts) through the Trainer under fsdp2 with expert_parallel_size=2:
    each rank holds 2 of the 4 experts of each layer, with their global names; losses, gradient norms (clipped:
    the held experts' norms summed over ep) and final parameters equal one process's, and the step-2 checkpoint
    (each expert saved by the rank holding it) resumes under plain fsdp2 to the uninterrupted losses."""
    ref, run = one_process["litgpt_fp64"], ep_two_ranks["ep_litgpt_fp64"]
    assert len(run["losses"]) == len(ref["losses"]) == 8
    _assert_trains_like(ref, run)
    resumed = ep_two_ranks["resume_litgpt_ep_to_fsdp2"]["losses"]
    assert len(resumed) == 4 and max(abs(a - b) for a, b in zip(run["losses"][4:], resumed)) <= FP64_TOL


# ------------------------------------------------------------------------------- 4 processes: dp_shard4 × ep2
@pytest.fixture(scope="module")
def ep2_of_four(tmp_path_factory) -> dict[str, Any]:
    scenarios = ["ep2_of_4_unseeded", "ep2_of_4_fp64", "resume_ep2_to_ep4", "resume_ep2_of_4_to_fsdp2"]
    scenarios += ["litgpt_ep2_of_4_fp64", *LITGPT_RESUMES, *HYBRID3D_MESHES, *LITGPT_MESHES]
    scenarios.append("pp2_dp2_ep2_qwen3_moe_aux_fp64")
    return run_scenarios(SCRIPT, 4, tmp_path_factory.mktemp("ep2_of_4"), scenarios)


@pytest.mark.slow
def test_every_rank_sees_the_same_experts_without_a_seed(ep2_of_four):
    """dp_shard=4, ep=2, every rank initialized its own weights (no common seed): FSDP2 shards each expert weight
    over the 2 ranks ep leaves (ep_fsdp), so whole, as every rank gathers it, each expert weight is the same on all
    4 ranks after setup and stays so through training."""
    gaps = ep2_of_four["ep2_of_4_unseeded"]["replica_gap"]
    assert gaps == {"after_setup": 0.0, "after_training": 0.0}, gaps


@pytest.mark.slow
def test_fsdp2_with_dp_shard4_and_ep2_trains_mixtral_like_one_process(one_process, ep2_of_four):
    """Two ep groups of 2 ranks, each rank 2 of 4 experts, FSDP2-sharded again over the 2 ranks ep leaves
    (ep_fsdp): rank 0 holds a quarter of the expert weights, not a half. Losses, gradient norms and final
    parameters equal one process's (fp64)."""
    ref, run = one_process["fp64"], ep2_of_four["ep2_of_4_fp64"]
    assert len(run["losses"]) == len(ref["losses"]) == 8
    assert max(abs(a - b) for a, b in zip(ref["losses"], run["losses"])) <= FP64_TOL
    assert max(abs(a - b) for a, b in zip(ref["grad_norms"], run["grad_norms"])) <= FP64_TOL
    assert _max_param_diff(ref["params"], run["params"]) <= FP64_TOL
    assert run["expert_fraction"] == 0.25  # 1 / (ep × ep_fsdp)


@pytest.mark.slow
def test_a_checkpoint_saved_under_ep2_of_dp4_resumes_under_ep4_and_plain_fsdp2(ep2_of_four):
    """The step-2 checkpoint of the dp_shard4 × ep2 run (2 experts per rank, FSDP2-sharded over ep_fsdp=2) resumes
    with ep=4 (1 expert per rank, whole) and under plain fsdp2, and both continue to the uninterrupted run's
    losses."""
    uninterrupted = ep2_of_four["ep2_of_4_fp64"]["losses"]
    for name in ("resume_ep2_to_ep4", "resume_ep2_of_4_to_fsdp2"):
        resumed = ep2_of_four[name]["losses"]
        assert len(resumed) == 4
        assert max(abs(a - b) for a, b in zip(uninterrupted[4:], resumed)) <= FP64_TOL, (name, uninterrupted, resumed)


# the resume under ep=4 only under LIGHTNING_DIST_FULL_MATRIX=1 (tests/launch.py): the Mixtral run resumes under ep=4
LITGPT_RESUMES = ["resume_litgpt_ep2_of_4_to_fsdp2"] + (["resume_litgpt_ep2_of_4_to_ep4"] if FULL_MATRIX else [])


@pytest.mark.slow
def test_litgpt_moe_under_dp_shard4_and_ep2_shards_its_experts_and_resumes_across_ep_sizes(one_process, ep2_of_four):
    """litgpt's ModuleList experts at dp_shard=4 × ep=2: each rank's 2 experts are FSDP2 units over the 2 ranks ep
    leaves, so a rank holds a quarter of the expert weights. Losses, clipped gradient norms and final parameters
    equal one process's (fp64); the step-2 checkpoint resumes under ep=4 and plain fsdp2 to the same losses."""
    ref, run = one_process["litgpt_fp64"], ep2_of_four["litgpt_ep2_of_4_fp64"]
    _assert_trains_like(ref, run)
    experts = sum(torch.tensor(v).numel() for k, v in ref["params"].items() if "experts" in k)
    assert run["expert_local_numel"] / experts == 0.25
    for name in LITGPT_RESUMES:
        resumed = ep2_of_four[name]["losses"]
        assert len(resumed) == 4 and max(abs(a - b) for a, b in zip(run["losses"][4:], resumed)) <= FP64_TOL, name


@pytest.mark.slow
def test_a_meta_device_litgpt_moe_keeps_each_ranks_experts(ep_two_ranks):
    """Built under trainer.init_module(empty_init=True): materializing after the split makes new parameter objects;
    once set up, each rank still holds its own experts (rank 1's experts 2-3 were once overwritten with rank 0's
    0-1 by the replicated-state broadcast, which the marks on the held experts' parameters prevent), and one clipped
    step leaves every weight finite."""
    run = ep_two_ranks["litgpt_empty_init"]
    assert run["expert_0_vs_2"] > 0.0 and run["finite"], run


@pytest.mark.slow
def test_zeropp_carries_expert_parallelism_within_its_stated_tolerance(one_process, ep_two_ranks):
    """ZeroPPStrategy(expert_parallel_size=2): the experts split over ep and left out of ZeRO++'s quantized
    collectives, the dense parts with int8 weight all-gathers and int4 gradient reduce-scatters. ZeRO++ quantizes on
    purpose and is held to what it states (as in the compatibility matrix): every loss within 5e-2 relative of one
    process's; the copies of the replicated parameters stay equal."""
    ref, run = one_process["fp32"], ep_two_ranks["zeropp_ep_fp32"]
    assert len(run["losses"]) == len(ref["losses"]) == 8
    assert max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"])) <= 5e-2, (
        run["losses"],
        ref["losses"],
    )
    assert run["copies_gap"] == 0.0


@pytest.mark.slow
def test_log_expert_load_logs_each_layers_max_over_mean_tokens_per_expert(ep_two_ranks, ep2_of_four):
    """log_expert_load=True: every training step logs expert_load/<experts module> for each MoE layer, a value
    between 1 (balanced) and E / top_k = 2 (collapsed); under pp2 × dp2 × ep2 every rank logs both stages' layers."""
    names = {f"expert_load/model.model.layers.{i}.mlp.experts" for i in range(2)}
    for load in (ep_two_ranks["ep_fp32"]["expert_load"], ep2_of_four["pp2_dp2_ep2"]["expert_load"]):
        assert set(load) == names, load
        assert all(1.0 <= value <= 2.0 for value in load.values()), load


# hybrid3d with expert_parallel_size=2 (the pp2_dp2_ep2 and tp2_ep2 scenarios): the mesh each one resolves to.
HYBRID3D_MESHES = {
    "pp2_dp2_ep2": "pp=2 × dp_shard=2 (ep=2 of dp_shard × cp)",
    "tp2_ep2": "dp_shard=2 × tp=2 (ep=2 of dp_shard × cp)",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", HYBRID3D_MESHES)
def test_hybrid3d_with_ep2_trains_mixtral_like_one_process(one_process, ep2_of_four, name):
    """pp2 × dp2 × ep2: each pipeline stage splits its own MoE layer's experts over its 2 data-parallel ranks.
    tp2 × ep2: attention tensor-parallel, the experts split over the data-parallel ranks and replicated over tp
    (gradients averaged over tp, so the copies stay bitwise equal). Losses, gradient norms and final parameters
    equal one process's (fp64); every rank holds 2 of the 4 experts of its layers."""
    ref, run = one_process["fp64"], ep2_of_four[name]
    assert run["mesh"] == HYBRID3D_MESHES[name]
    assert len(run["losses"]) == len(ref["losses"]) == 8
    _assert_trains_like(ref, run)
    assert run["expert_local_shapes"] == ["(2, 32, 48)", "(2, 96, 32)"]  # gate_up (E/ep, 2I, H), down (E/ep, H, I)
    assert any("2 per rank over ep=2" in line for line in run["log"]), run["log"]


LITGPT_MESHES = {
    "litgpt_pp2_dp2_ep2": "pp=2 × dp_shard=2 (ep=2 of dp_shard × cp)",
    "litgpt_tp2_ep2": "dp_shard=2 × tp=2 (ep=2 of dp_shard × cp)",
}
if not FULL_MATRIX:  # tp × ep runs with the Mixtral-like model above (tp2_ep2); litgpt's experts at pp × dp × ep
    del LITGPT_MESHES["litgpt_tp2_ep2"]


@pytest.mark.slow
@pytest.mark.parametrize("name", LITGPT_MESHES)
def test_litgpt_moe_under_hybrid3d_with_ep2_trains_like_one_process(one_process, ep2_of_four, name):
    """litgpt's LLaMAMoE through hybrid3d. pp2 × dp2 × ep2: each stage splits its layer's ModuleList experts over
    its 2 data-parallel ranks (the stage's shapes inferred on meta with the MoE layer shaped like its input: its own
    forward calls nonzero). tp2 × ep2 with the automatic plan: attention tensor-parallel, the MoE layers left whole
    (the plan would have sharded the expert MLPs like any MLP: 6e-4 off on the first loss). Losses, clipped gradient
    norms and final parameters equal one process's (fp64)."""
    ref, run = one_process["litgpt_fp64"], ep2_of_four[name]
    assert run["mesh"] == LITGPT_MESHES[name]
    _assert_trains_like(ref, run)


@pytest.mark.slow
def test_the_router_auxiliary_loss_crosses_pipeline_stages(one_process, ep_two_ranks, ep2_of_four):
    """Qwen3-MoE with output_router_logits=True under pipeline stages: each stage sends its routing statistics on
    with the activation and the last stage's loss sums every stage's (each stage alone was 2e-3 off). With one
    micro-batch per step, pp2 × dp2 × ep2 equals one process (the loss to fp32's rounding of the auxiliary loss,
    gradient norms and parameters to fp64's); with two, the loss is each micro-batch's, exactly as one process
    computes it accumulating batches half as large, and not the whole batch's."""
    ref, run = one_process["qwen3_moe_aux_fp64"], ep2_of_four["pp2_dp2_ep2_qwen3_moe_aux_fp64"]
    assert run["mesh"] == "pp=2 × dp_shard=2 (ep=2 of dp_shard × cp)"
    assert len(run["losses"]) == len(ref["losses"]) == 4
    assert max(abs(a - b) for a, b in zip(ref["losses"], run["losses"])) <= 1e-6
    assert max(abs(a - b) for a, b in zip(ref["grad_norms"], run["grad_norms"])) <= FP64_TOL
    assert _max_param_diff(ref["params"], run["params"]) <= FP64_TOL
    assert any("router auxiliary loss: each stage sends its routing statistics" in line for line in run["log"])
    half, two = one_process["half_batches_qwen3_moe_aux_fp64"], ep_two_ranks["pp2_microbatches2_qwen3_moe_aux_fp64"]
    assert max(abs(a - b) for a, b in zip(half["grad_norms"], two["grad_norms"])) <= FP64_TOL
    assert _max_param_diff(half["params"], two["params"]) <= FP64_TOL
    assert max(abs(a - b) for a, b in zip(ref["grad_norms"], two["grad_norms"])) > 1e-4  # not the whole batch's
