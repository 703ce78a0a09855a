"""Gradient accumulation under fsdp2: deferring the gradient reduction to the last micro-batch trains exactly like
reducing after every micro-batch (and like one process), with 1/k of the reduce-scatter bytes per optimizer step
and, in exchange, the full unsharded gradients held between micro-batches."""

from __future__ import annotations

import pytest
import torch
from launch import FULL_MATRIX, max_abs_diff, run_scenarios

from lightning_dist import FSDP2Strategy
from lightning_dist.parallel.mesh import MeshConfigError

ACCUMULATE = 4


@pytest.mark.slow
def test_deferred_sync_matches_per_micro_batch_sync_with_one_kth_of_the_bytes(tmp_path):
    every_last = run_scenarios("accumulation_runs.py", 2, tmp_path, ["every", "last", "hybrid_every", "replicas_last"])
    one = run_scenarios("accumulation_runs.py", 1, tmp_path, ["every"])["every"]
    every, last = every_last["every"], every_last["last"]
    assert len(every["losses"]) == 3 * ACCUMULATE
    assert max_abs_diff(every["losses"], last["losses"]) < 1e-10
    assert max_abs_diff(every["grad_norms"], last["grad_norms"]) < 1e-10
    assert max_abs_diff(one["losses"], last["losses"]) < 1e-10
    p_every = torch.load(tmp_path / "accumulate_every_d2.pt")
    p_last = torch.load(tmp_path / "accumulate_last_d2.pt")
    p_one = torch.load(tmp_path / "accumulate_every_d1.pt")
    assert max((p_every[k] - p_last[k]).abs().max().item() for k in p_every) < 1e-10
    assert max((p_one[k] - p_last[k]).abs().max().item() for k in p_one) < 1e-10
    assert last["reduce_scatter_bytes_per_step"] * ACCUMULATE == every["reduce_scatter_bytes_per_step"]
    # the trade: unsharded gradients of every unit are held between micro-batches (2 ranks: 2× the sharded bytes)
    assert last["peak_gradient_bytes"] > 1.9 * every["peak_gradient_bytes"]
    hybrid, replicas_last = every_last["hybrid_every"], every_last["replicas_last"]
    assert max_abs_diff(hybrid["losses"], replicas_last["losses"]) < 1e-10
    assert max_abs_diff(one["losses"], replicas_last["losses"]) < 1e-10
    assert replicas_last["all_reduce_bytes_per_step"] * ACCUMULATE == hybrid["all_reduce_bytes_per_step"] > 0
    assert replicas_last["peak_gradient_bytes"] == hybrid["peak_gradient_bytes"]  # nothing extra is held
    print(
        f"reduce-scatter bytes/step: every {every['reduce_scatter_bytes_per_step']:.0f},"
        f" last {last['reduce_scatter_bytes_per_step']:.0f}; peak gradient bytes: every"
        f" {every['peak_gradient_bytes']}, last {last['peak_gradient_bytes']}"
    )


def test_replicas_last_needs_replica_groups():
    import lightning as L

    with pytest.raises(MeshConfigError, match="accumulation_sync='replicas_last'.*sharding='hybrid'"):
        L.Trainer(strategy=FSDP2Strategy(accumulation_sync="replicas_last"), accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match="accumulation_sync='sometimes' is not one of"):
        FSDP2Strategy(accumulation_sync="sometimes")


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX, reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): deferred sync runs under fsdp2 by default"
)
def test_deferred_sync_under_context_parallel_matches_one_process(tmp_path):
    """accumulation_sync, once an fsdp2/zeropp/hybrid3d option only, on context_parallel (cp=2: FSDP2 shards over
    cp): "last" trains as "every" and as one process, with 1/k of the reduce-scatter bytes."""
    runs = run_scenarios("accumulation_runs.py", 2, tmp_path, ["cp_every", "cp_last"])
    one = run_scenarios("accumulation_runs.py", 1, tmp_path, ["every"])["every"]
    every, last = runs["cp_every"], runs["cp_last"]
    assert len(last["losses"]) == 3 * ACCUMULATE
    assert max_abs_diff(every["losses"], last["losses"]) < 1e-10
    assert max_abs_diff(one["losses"], last["losses"]) < 1e-10
    p_last, p_one = torch.load(tmp_path / "accumulate_cp_last_d2.pt"), torch.load(tmp_path / "accumulate_every_d1.pt")
    assert max((p_one[k] - p_last[k]).abs().max().item() for k in p_one) < 1e-10
    assert last["reduce_scatter_bytes_per_step"] * ACCUMULATE == every["reduce_scatter_bytes_per_step"] > 0
