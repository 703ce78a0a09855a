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


def test_rank_zero_alone_loads_the_checkpoint_folder_after_a_fit(tmp_path):
    """``if trainer.is_global_zero: MyModule.load_from_checkpoint(best_folder)`` after a 2-rank fsdp2 fit, then a test
    on every rank. Before: the folder's checksums were verified as a collective whenever a process group existed, so
    rank 0 alone verified half the files and its all-gather met the other rank's next collective: the job hung. Now
    the load verifies every file in the one process and uses no collective; the weights equal the trained ones."""
    run = run_scenarios(SCRIPT, 2, tmp_path, ["load_on_rank_zero"], timeout=180)["load_on_rank_zero"]
    assert run["gap"] == 0.0 and run["test_loss"] > 0
