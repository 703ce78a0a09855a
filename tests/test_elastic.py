"""``torchrun --max-restarts=1`` restarts a 2-process fsdp2 run whose rank 1 was SIGKILLed mid-epoch at step 5; the
script passes ``ckpt_path="last"``, so the second attempt resumes from the step-4 checkpoint by itself and ends
where an uninterrupted one-process run ends (fp64 ≤ 1e-10). Resuming on another world size (4 → 2, 2 → 4) is in
``test_checkpoint_resume.py``."""

from __future__ import annotations

import pytest
from launch import FULL_MATRIX, max_abs_diff, run_on_loopback_nodes, run_scenarios

pytestmark = pytest.mark.slow

FP64_TOL = 1e-10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("elastic")
    reference = run_scenarios("elastic_runs.py", 1, workdir, ["reference"])["reference"]
    restarted = run_on_loopback_nodes(
        "elastic_runs.py", 1, 2, workdir, ["elastic"], torchrun_args=("--max-restarts=1",)
    )["elastic"]
    return reference, restarted


@pytest.mark.skipif(
    not FULL_MATRIX, reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): a torchrun restart of 2 nodes (~25 s)"
)
def test_the_restarted_attempt_resumes_from_the_last_checkpoint(runs):
    reference, restarted = runs
    assert restarted["attempt"] == 1 and restarted["global_step"] == reference["global_step"] == 8
    assert len(restarted["losses"]) == 4  # steps 4..7: it started at the step-4 checkpoint, not from scratch
    assert max_abs_diff(restarted["losses"], reference["losses"][4:]) <= FP64_TOL


@pytest.mark.skipif(
    not FULL_MATRIX, reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): a torchrun restart of 2 nodes (~25 s)"
)
def test_the_restarted_run_ends_with_the_uninterrupted_parameters(runs):
    reference, restarted = runs
    worst = max(max_abs_diff(restarted["params"][k], v) for k, v in reference["params"].items())
    assert worst <= FP64_TOL
