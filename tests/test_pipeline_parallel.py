"""Pipeline stages cut from unchanged models, on real processes (gloo, fp64), against one process on the whole batch.

One launch (tests/scenarios/pipeline_runs.py) runs every case: the example GPT through all seven torch schedules at
pp=2 (interleaved, looped BFS and zero-bubble with two stages per rank), gpipe and 1f1b at pp=4, 1f1b at pp2 × dp2
with FSDP2 inside each stage, 1f1b at pp2 × tp2 (the MLPs column/row parallel inside each stage), a meta-device build that materialises only local stages, a stock transformers
LlamaForCausalLM with `labels=`, and GPT-2 with its tied embedding (Megatron-style copies on the first and last stage).
Per case: the mean of the per-micro-batch losses, every gradient and every parameter after an optimizer step, and
then the loss of a forward-only evaluation of a half-size batch (another shape, the pipeline's own forward-only pass).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from launch import REPO_ROOT, SCENARIO_DIR

pytestmark = pytest.mark.slow

TOL = 1e-10  # fp64: the same operations, in micro-batches, in other processes
HF_LOSS_TOL = 1e-6  # transformers' ForCausalLMLoss casts logits to fp32, so its loss value is fp32-exact only

SCHEDULES_PP2 = [
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
    "dualpipev",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline") / "pipeline.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, str(SCENARIO_DIR / "pipeline_runs.py"), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=500, check=False)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("schedule", SCHEDULES_PP2)
def test_every_schedule_matches_one_process(runs, schedule):
    result = runs[f"gpt_{schedule}"]
    assert result["loss_error"] < TOL and result["grad_error"] < TOL and result["param_error"] < TOL, result
    assert result["eval_error"] < TOL, result
    # every parameter is on exactly one rank, under its original name
    assert sum(result["params_per_rank"]) == result["reference_params"]


@pytest.mark.parametrize(
    "case", ["gpt_gpipe_pp4", "gpt_1f1b_pp4", "gpt_1f1b_pp2_dp2_fsdp", "gpt_1f1b_pp2_tp2", "gpt_1f1b_meta"]
)
def test_four_stages_fsdp_or_tp_inside_stages_and_meta_init_match_one_process(runs, case):
    result = runs[case]
    assert result["loss_error"] < TOL and result["grad_error"] < TOL and result["param_error"] < TOL, result
    assert result["eval_error"] < TOL, result


def test_parameter_bytes_per_rank_are_a_stage_share(runs):
    pp4 = runs["gpt_1f1b_pp4"]
    assert sum(pp4["param_bytes_per_rank"]) == pp4["reference_bytes"]
    assert max(pp4["param_bytes_per_rank"]) < 0.3 * pp4["reference_bytes"]
    fsdp = runs["gpt_1f1b_pp2_dp2_fsdp"]  # pp2 × dp2: each rank holds half of its stage
    assert max(fsdp["param_bytes_per_rank"]) < 0.27 * fsdp["reference_bytes"]


def test_stock_llama_with_labels_matches_one_process(runs):
    result = runs["llama_1f1b"]
    assert result["eval_error"] < HF_LOSS_TOL
    assert result["loss_error"] < HF_LOSS_TOL and result["grad_error"] < TOL and result["param_error"] < TOL, result
    assert sum(result["params_per_rank"]) == result["reference_params"]


@pytest.mark.parametrize("case", ["gpt2_tied_1f1b", "gpt2_tied_zbv_zero_bubble"])
def test_tied_embedding_copies_train_as_one_parameter(runs, case):
    result = runs[case]
    last = 1 if "1f1b" in case else 3
    assert result["ties"] == [f"transformer.wte.weight (stage 0) = lm_head.weight (stage {last})"]
    assert result["eval_error"] < HF_LOSS_TOL
    # both copies are compared with the one-process parameter (and its gradient, the sum of both uses)
    assert result["loss_error"] < HF_LOSS_TOL and result["grad_error"] < TOL and result["param_error"] < TOL, result
    assert sum(result["params_per_rank"]) == result["reference_params"]  # reference counts both names
