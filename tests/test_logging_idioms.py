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
    epoch under pipeline (GPipe, 1F1B with 4 micro-batches, interleaved 1F1B) and hybrid3d with pp (pp2, and
    pp2 × dp2 with 4 micro-batches): each step's value covers all the step's micro-batches and the epoch value is the
    metric's whole state, as in one process. (Before: the step value was the last micro-batch's, and the epoch value
    counted torch's shape-inference call on placeholder values.) Values logged with reduce_fx sum (tokens, samples),
    max and min, in training and validation, equal one process's in callback_metrics (per step, per epoch, and the
    fit's validation) and in validate's result (before: sums were averaged over micro-batches, 4× too small); so do
    they under tensor parallel (tp2). Under context parallel a Metric's step value is per rank, as under DDP."""
    one = run_scenarios("metric_log_runs.py", 1, tmp_path, ["reference"])["reference"]
    pipelines = ["gpipe", "1f1b", "interleaved_1f1b", "hybrid3d_pp2"]
    runs = run_scenarios("metric_log_runs.py", 2, tmp_path, [*pipelines, "tensor_parallel", "context_parallel"])
    runs.update(run_scenarios("metric_log_runs.py", 4, tmp_path, ["hybrid3d_pp2_dp2"]))
    assert len(one["steps"]["train_acc"]) == 4 and 0 < one["epoch"]["train_acc"] < 1
    assert one["steps"]["train_samples"] == [8.0] * 4 and one["epoch"]["train_samples"] == 32.0
    assert one["epoch"]["val_samples"] == 16.0 and one["steps"]["train_tokens"][0] > 8 * 8
    assert one["epoch"]["train_logit_max"] > one["epoch"]["train_logit_min"]
    assert {"val_tokens", "val_samples", "val_logit_max", "val_logit_min", "val_acc"} <= one["epoch"].keys()
    cp = runs.pop("context_parallel")
    for name, run in runs.items():
        for key, values in one["steps"].items():
            if key in ("train_acc", "val_acc") and name.endswith("_dp2"):
                continue  # a Metric's step value is the data-parallel rank's own samples', as under DDP
            assert max(abs(a - b) for a, b in zip(run["steps"][key], values, strict=True)) <= 1e-6, (name, key)
        assert run["epoch"].keys() == one["epoch"].keys() and run["fit_val"].keys() == one["fit_val"].keys()
        for key in one["epoch"]:
            assert abs(run["epoch"][key] - one["epoch"][key]) <= 1e-6, (name, key)
        for key in one["fit_val"]:
            assert abs(run["fit_val"][key] - one["fit_val"][key]) <= 1e-6, (name, key)
        assert run["warned"] == [], name
    # context parallel (same launch): epoch values and synced plain step values are the whole batch's; a Metric's
    # step value is rank 0's sequence shard's, as under DDP it is the rank's own samples'. A sum over the default
    # group counts a per-sample value once per cp rank (2×) and warns once per name; the token count (per token) and
    # the sample count synced over data_parallel_group are one process's.
    assert cp["steps"]["train_acc"] != one["steps"]["train_acc"]
    for key, values in one["steps"].items():
        if key in ("train_acc", "val_acc"):
            continue
        factor = 2 if key.endswith("_samples_default") else 1
        assert max(abs(a - factor * b) for a, b in zip(cp["steps"][key], values, strict=True)) <= 1e-6, key
    for key, value in one["epoch"].items():
        factor = 2 if key.endswith("_samples_default") else 1
        assert abs(cp["epoch"][key] - factor * value) <= 1e-6, key
    warned = sorted(message.split("'")[1] for message in cp["warned"])
    assert warned == ["train_samples_default", "train_tokens", "val_samples_default", "val_tokens"], cp["warned"]
    assert "sync_dist_group=getattr(self.trainer.strategy, 'data_parallel_group', None)" in cp["warned"][0]
