"""LoRA (PEFT's ``get_peft_model``) under tensor parallelism: a LoRA-wrapped linear is sharded as its base layer.

Without launches: the plans of a stock Llama with LoRA on q_proj/v_proj (the wrapped projections sharded like the
unwrapped model's, lora_B column-wise), Qwen3 with LoRA on every projection under sequence parallel (lora_A row-wise
under o_proj/down_proj, their dropout drawing the whole activation's mask), Phi-3's fused projections, and the
adapters the plan leaves whole (DoRA, LoHa, a LoRA-wrapped head), named with why in the plan's summary.

Against one process (fp64, 1e-10; one reference launch and one 2-process launch of ``scenarios/lora_runs.py``, and
in the full matrix one 4-process launch): losses, LoRA parameters after 6 AdamW steps and frozen weights unchanged,
at tp=2 for the Llama (then ``merge_and_unload()``), the Qwen3 (LoRA dropout 0.1 on every projection, with and
without sequence parallel) and the Phi-3, whose tp=2 checkpoint holds PEFT's keys and resumes under fsdp2; in the
full matrix dp2 × tp2 and hybrid3d pp2 × tp2.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launch import FULL_MATRIX, max_abs_diff, run_scenarios
from torch import nn

from lightning_dist.parallel.tensor_parallel import TensorParallelPlanError, infer_plan, resolve_explicit_plan
from lightning_dist.parallel.tensor_parallel.lora import shard_dropout
from tests.scenarios.models import LoraCausalLM, lora_base_model, phi3_model

peft = pytest.importorskip("peft")

SCRIPT = "lora_runs.py"
# LIGHTNING_DIST_FULL_MATRIX=1 also runs dp2 × tp2 and hybrid3d pp2 × tp2 (one 4-process launch, about 35 s of the
# suite on 2 cores): the LoRA plan is the tp=2 one, FSDP2 over it and the pipeline split run elsewhere.
FOUR_RANKS = ["llama", "llama_hybrid3d"]
FP64_TOL = 1e-10
WRAPPED = "base_model.model."  # PeftModelForCausalLM → LoraModel → the wrapped model
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(model: nn.Module, **config) -> nn.Module:
    return peft.get_peft_model(model, peft.LoraConfig(r=8, **config))


def test_lora_on_q_and_v_shards_the_wrapped_projections_as_the_unwrapped_model():
    """The issue's setup: before, q_proj/v_proj were not recognised and both attention modules stayed whole (3
    row-wise / 5 column-wise, nothing said). Now each base layer gets the unwrapped projection's style, lora_B is
    split with it and lora_A stays whole; head counts, checks and key/value grouping are the unwrapped model's."""
    plain = infer_plan(lora_base_model("llama"))
    model = _lora(lora_base_model("llama"), target_modules=["q_proj", "v_proj"])
    plan = infer_plan(model)
    bases = {
        n.removeprefix(WRAPPED).removesuffix(".base_layer"): s for n, s in plan.styles.items() if ".lora_" not in n
    }
    assert bases == plain.styles
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            name = f"{WRAPPED}model.layers.{layer}.self_attn.{proj}"
            assert plan.styles[f"{name}.base_layer"] == plan.styles[f"{name}.lora_B.default"] == "colwise"
            assert plan.styles[f"{name}.lora_A.default"] == "replicate"
            assert plan.lora[name] == "colwise"
    assert plan.summary() == (
        "5 rowwise, 11 colwise, 4 LoRA-wrapped layers sharded as their base: 4 with a column-wise base"
        " (lora_B split, lora_A whole)"
    )
    assert not plan.unplanned and not plan.unreduced
    assert {k.removeprefix(WRAPPED): v for k, v in plan.grouped_query.items()} == plain.grouped_query
    assert {(c.module.removeprefix(WRAPPED), c.value) for c in plan.checks} == {
        (c.module, c.value) for c in plain.checks
    }
    plan.validate(2)
    # the printed plan parses back to the same plan, and a user's plan naming the wrapped layers is expanded alike
    again = resolve_explicit_plan(model, plan.compact(model))
    assert (again.styles, again.lora) == (plan.styles, plan.lora)
    attention = f"{WRAPPED}model.layers.*.self_attn"
    named = resolve_explicit_plan(model, {f"{attention}.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")})
    assert named.styles == {n: s for n, s in plan.styles.items() if ".self_attn." in n and "o_proj" not in n}


def test_lora_on_row_wise_layers_splits_lora_a_and_draws_whole_dropout_masks():
    """o_proj/down_proj (row-wise): lora_A row-wise like its base (reduce-scattered on the sequence under sequence
    parallel), lora_B whole (on the rank's slice of the sequence), and the dropout before lora_A, whose input is this
    rank's features only, draws the whole activation's mask. Qwen3's per-head norms stay summed over tp."""
    model = _lora(lora_base_model("qwen3"), target_modules=ALL_LINEAR, lora_dropout=0.1)
    plan = infer_plan(model, sequence_parallel=True)
    layer = f"{WRAPPED}model.layers.0"
    for proj in ("self_attn.o_proj", "mlp.down_proj"):
        name = f"{layer}.{proj}"
        row = {"style": "rowwise", "output_layouts": "shard(1)"}
        assert plan.styles[f"{name}.base_layer"] == plan.styles[f"{name}.lora_A.default"] == row
        assert plan.styles[f"{name}.lora_B.default"] == {
            "style": "sequence_parallel",
            "sequence_dim": 1,
            "use_local_output": True,
        }
        assert plan.styles[f"{name}.lora_dropout.default"] == {"style": "sharded_dropout", "input_layouts": "shard(-1)"}
    assert f"{layer}.self_attn.q_proj.lora_dropout.default" not in plan.styles  # lora_A reads the whole input
    assert f"{layer}.self_attn.q_norm.weight" not in plan.partial_over_tp  # frozen: no gradient to sum
    assert "4 with a row-wise base (lora_A split, lora_B whole)" in plan.summary()
    plan.validate(2)
    assert infer_plan(model).styles[f"{layer}.mlp.down_proj.lora_B.default"] == "replicate"


def test_lora_on_fused_projections_splits_lora_b_in_the_base_layers_row_order():
    """Phi-3's qkv_proj (by heads, rows put in rank order) and gate_up_proj (matching halves): lora_B's output rows
    are the base layer's, so it gets the same fused style."""
    model = _lora(phi3_model(16), target_modules=["qkv_proj", "gate_up_proj"])
    plan = infer_plan(model)
    for proj, style in (("self_attn.qkv_proj", "fused_colwise"), ("mlp.gate_up_proj", "fused_gate_up")):
        name = f"{WRAPPED}model.layers.1.{proj}"
        assert plan.styles[f"{name}.lora_B.default"] == plan.styles[f"{name}.base_layer"]
        assert (plan.lora[name], plan.styles[f"{name}.lora_A.default"]) == (style, "replicate")
    plan.validate(2)


def test_adapters_the_plan_cannot_split_are_left_whole_and_named_with_why():
    """DoRA (its magnitude vector normalises the whole weight) and LoHa on q_proj/v_proj leave their attention whole;
    a LoRA-wrapped output head is not sharded. The plan's summary (its log line) names each with the reason, and
    sequence parallel, under which a whole head would see a slice of the sequence, is refused."""
    dora = infer_plan(_lora(lora_base_model("llama"), target_modules=["q_proj", "v_proj"], use_dora=True))
    attention = f"{WRAPPED}model.layers.*.self_attn"
    assert dora.summary().startswith(
        f"3 rowwise, 5 colwise, left whole: {attention}.q_proj, {attention}.v_proj (a LoRA variant (DoRA"
    )
    assert "the attention module holding it is left whole" in dora.summary()
    loha = peft.get_peft_model(lora_base_model("llama"), peft.LoHaConfig(r=8, target_modules=["q_proj"]))
    assert "a PEFT Linear adapter layer (peft.tuners.loha.layer)" in infer_plan(loha).summary()
    head = _lora(lora_base_model("llama"), target_modules=["q_proj", "lm_head"])
    plan = infer_plan(head)
    assert plan.unplanned == {f"{WRAPPED}lm_head": plan.unplanned[f"{WRAPPED}lm_head"]}
    assert "a PEFT adapter layer outside the attention and MLP modules" in plan.summary()
    with pytest.raises(TensorParallelPlanError, match=r"lm_head: .*would see only this rank's slice of the sequence"):
        infer_plan(head, sequence_parallel=True).validate(2)
    head_plan = {f"{WRAPPED}lm_head": {"style": "colwise", "input_layouts": "shard(1)"}}
    with pytest.raises(TensorParallelPlanError, match=r"lm_head is a LoRA-wrapped layer"):
        resolve_explicit_plan(head, head_plan)


def test_the_dropout_of_a_shard_is_that_slice_of_one_process_dropout():
    """Each of 2 ranks draws the whole [2, 3, 8] mask from the same random state and keeps its 4 features: together
    exactly one process's dropout, and the random state advances as one process's does."""
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    torch.manual_seed(7)
    whole = F.dropout(x, 0.3, training=True)
    after = torch.get_rng_state()
    for index in range(2):
        dropout = shard_dropout(nn.Dropout(0.3), dim=-1, shards=2, index=index)
        torch.manual_seed(7)
        assert torch.equal(dropout(x[..., index * 4 : (index + 1) * 4]), whole[..., index * 4 : (index + 1) * 4])
        assert torch.equal(torch.get_rng_state(), after)
    assert torch.equal(dropout.eval()(x), x)


# ----------------------------------------------------------------------------------------- against one process


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp_lora")


@pytest.fixture(scope="module")
def reference(workdir: Path) -> dict:
    return run_scenarios(SCRIPT, 1, workdir, ["llama", "qwen3_all", "phi3"])


@pytest.fixture(scope="module")
def two_ranks(workdir: Path, reference: dict) -> dict:
    return run_scenarios(SCRIPT, 2, workdir, ["llama", "qwen3_all", "qwen3_all_sp", "phi3", "phi3_fsdp2_from_tp"])


@pytest.fixture(scope="module")
def four_ranks(workdir: Path, reference: dict) -> dict:
    return run_scenarios(SCRIPT, 4, workdir, FOUR_RANKS)


def _assert_matches_one_process(workdir: Path, run: dict, ref: dict, name: str, devices: int, base: str) -> None:
    """Losses and every LoRA parameter after the last step within 1e-10; frozen weights unchanged."""
    assert len(run["losses"]) == 6 and max_abs_diff(run["losses"], ref["losses"]) <= FP64_TOL
    ours, theirs = torch.load(workdir / f"{name}_d{devices}.pt"), torch.load(workdir / f"{base}_d1.pt")
    assert ours["params"] and set(ours["params"]) <= set(theirs["params"])  # a pipeline stage: its own layers
    for key, value in ours["params"].items():
        assert (value - theirs["params"][key]).abs().max().item() <= FP64_TOL, key
    assert run["frozen_compared"] > 0 and run["frozen_max_change"] == 0.0


@pytest.mark.slow
def test_lora_on_q_and_v_matches_one_process_with_the_wrapped_projections_sharded(workdir, reference, two_ranks):
    """tp=2: every base weight sharded as in the unwrapped model (q/k/v/gate/up/lm_head and the vocabulary-split
    embedding on dim 0, o/down on dim 1), lora_B on dim 0, lora_A replicated, norms whole; the log line says so."""
    run = two_ranks["llama"]
    _assert_matches_one_process(workdir, run, reference["llama"], "llama", 2, "llama")
    layouts = run["placements"]
    bases = Counter(v for n, v in layouts.items() if ".lora_" not in n and "norm" not in n)
    assert bases == {"S(0)": 12, "S(1)": 4}  # as the unwrapped model's: 11 column-wise + the embedding, 4 row-wise
    assert all(layouts[n] == "S(0)" for n in layouts if "_proj.base_layer" in n and ("q_proj" in n or "v_proj" in n))
    assert Counter(v for n, v in layouts.items() if ".lora_B." in n) == {"S(0)": 4}
    assert Counter(v for n, v in layouts.items() if ".lora_A." in n) == {"R": 4}
    assert Counter(v for n, v in layouts.items() if "norm" in n) == {"plain": 5}
    assert run["plan_lines"] == [
        (
            "tensor_parallel: auto plan over tp=2: 5 rowwise, 11 colwise, 4 LoRA-wrapped layers sharded as their"
            " base: 4 with a column-wise base (lora_B split, lora_A whole) (full plan: `lightning-dist plan`)"
        )
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_all", "qwen3_all_sp"])
def test_lora_dropout_on_every_projection_matches_one_process(workdir, reference, two_ranks, name):
    """Qwen3, LoRA with dropout 0.1 on all 7 projections: the masks before a whole lora_A are the one process's (the
    ranks start training from its random state), those before a row-wise lora_A the slices of its masks; under
    sequence parallel too, where the frozen norms also stay frozen."""
    run = two_ranks[name]
    _assert_matches_one_process(workdir, run, reference["qwen3_all"], name, 2, "qwen3_all")
    layouts = run["placements"]
    assert Counter(v for n, v in layouts.items() if ".lora_A." in n) == {"R": 10, "S(1)": 4}
    assert Counter(v for n, v in layouts.items() if ".lora_B." in n) == {"S(0)": 10, "R": 4}


@pytest.mark.slow
def test_merge_and_unload_after_training_matches_one_process(workdir, reference, two_ranks):
    """``merge_and_unload()`` on the tp=2 model adds B @ A to each base weight in its layout: the merged weights and
    the merged model's logits are one process's, and no LoRA module is left."""
    ours, theirs = torch.load(workdir / "llama_d2.pt"), torch.load(workdir / "llama_d1.pt")
    assert ours["merged"].keys() == theirs["merged"].keys() and len(ours["merged"]) == 4
    for key, value in theirs["merged"].items():
        assert (ours["merged"][key] - value).abs().max().item() <= FP64_TOL, key
    assert (ours["merged_logits"] - theirs["merged_logits"]).abs().max().item() <= FP64_TOL
    assert two_ranks["llama"]["merged_names"] == []


@pytest.mark.slow
def test_lora_on_fused_projections_matches_one_process_and_its_checkpoint_resumes_under_fsdp2(
    workdir, reference, two_ranks
):
    """Phi-3 with LoRA on qkv_proj and gate_up_proj (lora_B's rows permuted like the base layer's while sharded),
    o_proj and down_proj: tp=2 matches one process; its step-3 checkpoint holds PEFT's keys (it loads strictly into
    the one-process module) and resumes under fsdp2, which holds the rows unpermuted, to one process's losses."""
    from lightning_dist.checkpoint.consolidate import load_full_checkpoint

    _assert_matches_one_process(workdir, two_ranks["phi3"], reference["phi3"], "phi3", 2, "phi3")
    state = load_full_checkpoint(workdir / "ckpt_phi3_d2" / "step=3.ckpt")["state_dict"]
    original = LoraCausalLM("phi3", targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj")).double()
    original.load_state_dict(state, strict=True)
    resumed = two_ranks["phi3_fsdp2_from_tp"]
    assert resumed["global_step"] == 6
    assert max_abs_diff(resumed["losses"], reference["phi3"]["losses"][3:]) <= FP64_TOL


@pytest.mark.slow
@pytest.mark.skipif(not FULL_MATRIX, reason="4-rank LoRA runs are in the full matrix (LIGHTNING_DIST_FULL_MATRIX=1)")
@pytest.mark.parametrize("name", FOUR_RANKS)
def test_lora_under_2d_and_hybrid3d_matches_one_process(workdir, reference, four_ranks, name):
    """dp2 × tp2 (FSDP2 over the data-parallel axis on top of the LoRA plan) and hybrid3d pp2 × tp2."""
    run = four_ranks[name]
    _assert_matches_one_process(workdir, run, reference["llama"], name, 4, "llama")
    assert Counter(v for n, v in run["placements"].items() if ".lora_B." in n) == {"S(0)": 4 if name == "llama" else 2}
