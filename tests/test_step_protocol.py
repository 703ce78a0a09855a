"""The shared base's step protocol on real processes (2 ranks): train_context() is active through backward, where
activation checkpointing recomputes forward; on a pipeline mesh reduce() hands every rank the last stage's value and
gradient norms sum over the stages."""

from __future__ import annotations

import math

import pytest
from launch import run_scenarios

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_scenarios("protocol_runs.py", 2, tmp_path_factory.mktemp("protocol"), ["recompute", "stages"])


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
