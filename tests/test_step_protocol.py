"""The shared base's step protocol on real processes (2 ranks): train_context() is active through backward, where
activation checkpointing recomputes forward; on a pipeline mesh reduce() hands every rank the last stage's value and
gradient norms sum over the stages; and a hand-written pipeline (HandPipeline in tests/scenarios/protocol_runs.py:
the example GPT in four stages, two model parts per rank) trains, clips, saves, resumes strictly and saves a full
state exactly as one process trains the whole model (fp64, 1e-10)."""

from __future__ import annotations

import math

import pytest
from launch import max_abs_diff, run_scenarios

pytestmark = pytest.mark.slow

TOL = 1e-10  # fp64: the same operations in another order across two processes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("protocol")
    reference = run_scenarios("protocol_runs.py", 1, workdir, ["reference"])  # hand_pipeline reads its parameters
    return {**reference, **run_scenarios("protocol_runs.py", 2, workdir, ["recompute", "stages", "hand_pipeline"])}


def test_train_context_is_active_during_activation_checkpoint_recompute(runs):
    result = runs["recompute"]
    training = [inside for inside, grad in result["seen"] if grad]
    evaluation = [inside for inside, grad in result["seen"] if not grad]
    blocks, steps = result["blocks"], 2
    # every block ran twice per step: its forward, and its recompute inside backward
    assert len(training) == 2 * blocks * steps and all(training)
    assert evaluation and not any(evaluation)  # validation runs outside it
    assert result["open_after_fit"] is False


def test_reduce_and_gradient_norms_on_a_pipeline_mesh(runs):
    for rank in runs["stages"]["per_rank"]:
        assert rank["reduced"] == 10.0  # the loss stage's value, not the average with stage 0's placeholder
        assert rank["global_norm"] == pytest.approx(math.sqrt(4 * 1 + 4 * 4), abs=1e-12)
    assert [r["stage_norm"] for r in runs["stages"]["per_rank"]] == [2.0, 4.0]


def test_two_model_parts_per_rank_hold_only_their_stages(runs):
    ranks = runs["hand_pipeline"]["per_rank"]
    assert [len(r["parts"]) for r in ranks] == [2, 2]
    # stage 0 (embeddings, block 0) and stage 2 (block 2) on rank 0; stages 1 and 3 (block 3, ln_f, head) on rank 1
    assert {_owner(key) for key in ranks[0]["local_keys"]} == {"tok_emb", "pos_emb", "blocks.0", "blocks.2"}
    assert not set(ranks[0]["local_keys"]) & set(ranks[1]["local_keys"])
    assert sum(r["local_numel"] for r in ranks) == runs["hand_pipeline"]["model_numel"]
    for rank in ranks:  # configure_optimizers (self.parameters()) saw exactly the local parameters
        assert rank["optimizer_numel"] == rank["local_numel"]


def test_hand_pipeline_matches_one_process_with_clipping_over_stages(runs):
    reference = runs["reference"]
    assert min(reference["grad_norms"]) > 0.05  # the clip value: every step was clipped, by the norm over all stages
    for rank in runs["hand_pipeline"]["per_rank"]:  # every rank reports the loss stage's loss
        assert max_abs_diff(rank["losses"], reference["losses"]) <= TOL


def test_two_part_checkpoint_saves_resumes_strictly_and_gathers_full_state(runs):
    reference = runs["reference"]["losses"]
    for rank in runs["hand_pipeline"]["per_rank"]:
        # resumed at step 3 from a sharded checkpoint with strict loading: steps 4 and 5 continue the reference run
        assert max_abs_diff(rank["resumed_losses"], reference[3:]) <= TOL
        assert rank["param_diff"] <= TOL
    rank0 = runs["hand_pipeline"]["per_rank"][0]
    assert rank0["full_keys_match"]  # the full-state file holds both stages' parameters, under their original names
    assert rank0["full_diff"] <= TOL


def _owner(key: str) -> str:
    """``blocks.2.attn.query.weight`` → ``blocks.2``; ``tok_emb.weight`` → ``tok_emb``."""
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
