"""A model handed from one Trainer to the next (scenarios in ``tests/scenarios/model_reuse_runs.py``)."""

from __future__ import annotations

from launch import run_scenarios

SCRIPT = "model_reuse_runs.py"


def test_a_model_trained_by_one_trainer_trains_and_tests_under_the_next(tmp_path):
    """fit with one Trainer, fit again with a new Trainer (a new strategy, a fresh optimizer), then test with a third,
    fp64: the losses and the test loss equal one process's under fsdp2, tensor_parallel, pipeline, context_parallel
    and hybrid3d (pp2). Before: under the pipeline the second Trainer failed ("'PipelineStrategy' object has no
    attribute '_stage_ids'"; test: "'NoneType' object has no attribute '__dict__'"), under hybrid3d before launch ("The
    device mesh exists only after the processes have been initialized"), and under context_parallel it trained and
    tested with each rank's positions starting at 0 (second fit 0.09 from one process in loss): what the first
    strategy learned while parallelizing (the cut stages, where the positions go) was known to it only."""
    names = ["reuse_fsdp2", "reuse_tensor_parallel", "reuse_pipeline", "reuse_context_parallel", "reuse_hybrid3d"]
    runs = run_scenarios(SCRIPT, 2, tmp_path, names)
    one = run_scenarios(SCRIPT, 1, tmp_path, ["reuse_one_process"])["reuse_one_process"]
    assert len(one["losses"]) == 4
    for name, run in runs.items():
        assert max(abs(a - b) for a, b in zip(run["losses"], one["losses"])) <= 1e-10, name
        assert abs(run["test_loss"] - one["test_loss"]) <= 1e-10, name
