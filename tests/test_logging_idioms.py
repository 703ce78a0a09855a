"""Lightning's logging idioms give the values DDP (and one process) give, on sharded parameters: a synced
``param.norm()`` and the ``grad_norm`` helper in ``on_before_optimizer_step`` (fp64, 2 ranks)."""

from __future__ import annotations

import pytest
from launch import run_scenarios

pytestmark = pytest.mark.slow
TOL = 1e-10


def _assert_same(ours: list[dict], reference: list[dict]) -> None:
    assert len(ours) == len(reference) == 3
    for mine, ref in zip(ours, reference):
        assert mine.keys() == ref.keys() and "w_norm" in ref and "grad_2.0_norm_total" in ref
        assert len(ref) > 20  # one norm per parameter, plus the total
        assert max(abs(mine[k] - ref[k]) for k in ref) < TOL


def test_logged_norms_equal_ddp_under_fsdp2_and_one_process_under_tensor_parallel(tmp_path):
    runs = run_scenarios("idiom_runs.py", 2, tmp_path, ["fsdp2", "ddp", "tensor_parallel"])
    one = run_scenarios("idiom_runs.py", 1, tmp_path, ["one_process"])["one_process"]
    _assert_same(runs["fsdp2"]["values"], runs["ddp"]["values"])
    _assert_same(runs["tensor_parallel"]["values"], one["values"])  # tp peers see the whole batch
