"""Lightning's logging idioms give the values DDP (and one process) give, on sharded parameters: a synced
``param.norm()`` and the ``grad_norm`` helper in ``on_before_optimizer_step`` (fp64, 2 ranks). Under pipeline
(and hybrid3d with pp) logged training metrics, torchmetrics and plain, per step and per epoch, equal one process."""

from __future__ import annotations

import pytest
from launch import FULL_MATRIX, run_scenarios

pytestmark = pytest.mark.slow
TOL = 1e-10


def _assert_same(ours: list[dict], reference: list[dict]) -> None:
    assert len(ours) == len(reference) == 3
    for mine, ref in zip(ours, reference):
        assert mine.keys() == ref.keys() and "w_norm" in ref and "grad_2.0_norm_total" in ref
        assert len(ref) > 20  # one norm per parameter, plus the total
        assert max(abs(mine[k] - ref[k]) for k in ref) < TOL


@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): ~20 s; logged metrics equal one process under pipeline by default",
)
def test_logged_norms_equal_ddp_under_fsdp2_and_one_process_under_tensor_parallel(tmp_path):
    runs = run_scenarios("idiom_runs.py", 2, tmp_path, ["fsdp2", "ddp", "tensor_parallel"])
    one = run_scenarios("idiom_runs.py", 1, tmp_path, ["one_process"])["one_process"]
    _assert_same(runs["fsdp2"]["values"], runs["ddp"]["values"])
    _assert_same(runs["tensor_parallel"]["values"], one["values"])  # tp peers see the whole batch


def test_pipeline_logged_metrics_equal_one_process(tmp_path):
    """A torchmetrics Metric and a plain tensor logged in training_step (on_step and on_epoch, sync_dist) over one
    epoch under pipeline (GPipe, 1F1B, interleaved 1F1B) and hybrid3d with pp: each step's value covers all the
    step's micro-batches and the epoch value is the metric's whole state, as in one process. (Before: the step value
    was the last micro-batch's, and the epoch value counted torch's shape-inference call on placeholder values.) Under
    context parallel a Metric's step value is per rank, as under DDP."""
    one = run_scenarios("metric_log_runs.py", 1, tmp_path, ["reference"])["reference"]
    pipelines = ["gpipe", "1f1b", "interleaved_1f1b", "hybrid3d_pp2"]
    runs = run_scenarios("metric_log_runs.py", 2, tmp_path, [*pipelines, "context_parallel"])
    assert len(one["steps"]["train_acc"]) == 4 and 0 < one["epoch"]["train_acc"] < 1
    # context parallel (same launch): epoch values and synced plain step values are the whole batch's; a Metric's
    # step value is rank 0's sequence shard's, as under DDP it is the rank's own samples'
    cp = runs.pop("context_parallel")
    assert max(abs(a - b) for a, b in zip(cp["steps"]["train_hits"], one["steps"]["train_hits"], strict=True)) <= 1e-6
    assert cp["steps"]["train_acc"] != one["steps"]["train_acc"]
    assert all(abs(cp["epoch"][k] - one["epoch"][k]) <= 1e-6 for k in one["epoch"])
    for name, run in runs.items():
        for key, values in one["steps"].items():
            assert max(abs(a - b) for a, b in zip(run["steps"][key], values, strict=True)) <= 1e-6, (name, key)
            assert abs(run["epoch"][key] - one["epoch"][key]) <= 1e-6, (name, key)
