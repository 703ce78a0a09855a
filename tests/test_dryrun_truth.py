"""The dry run against real runs of the same configuration (benchmarks/studies/dryrun_truth.py): per rank, the
collectives after setup equal the real run's in kind, group and bytes (recorded by torch's profiler and flight
recorder, not by the package), and the steps' peak memory is within 10 % of the real run's. The ZBV pipeline runs by
default; every other strategy under LIGHTNING_DIST_FULL_MATRIX=1 (`python -m benchmarks.dryrun_truth` runs all)."""

from __future__ import annotations

import pytest
from launch import FULL_MATRIX

from benchmarks.studies.dryrun_truth import CASES, MEMORY_TOLERANCE, compare

DEFAULT = ["pipeline_zbv"]
FULL_MATRIX_ONLY = pytest.mark.skip(
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1); python -m benchmarks.dryrun_truth"
)
#: Expert parallelism's token all-to-alls carry the router's choices; the dry run assumes them balanced.
ROUTED = {"expert_parallel"}


@pytest.mark.parametrize(
    "case",
    [c if c in DEFAULT or FULL_MATRIX else pytest.param(c, marks=FULL_MATRIX_ONLY) for c in CASES],
)
def test_the_dry_run_issues_what_the_real_run_issues_and_needs_its_memory(tmp_path, case):
    result = compare(case, tmp_path)
    for rank in result["ranks"]:
        assert rank["error"] is None, rank
        if case in ROUTED:
            assert rank["equal_but_routing"], rank["first_difference"]
            assert rank["routed_bytes_deviation"] < 0.25
        else:
            assert rank["sequences_equal"], rank["first_difference"]
        assert rank["collectives"] > 0
        assert abs(rank["memory_ratio"] - 1) <= MEMORY_TOLERANCE, (rank["dry_memory"], rank["real_memory"])
    assert result["agree"]
