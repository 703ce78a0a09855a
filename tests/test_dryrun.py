"""``lightning-dist dryrun``: roles, the agreement check, the JSON, a planted rank-dependent branch and broken
configurations found before launch. (The comparison with real runs: tests/test_dryrun_truth.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import FULL_MATRIX

from lightning_dist.commands.dryrun import memory_size
from lightning_dist.dryrun import Collective, RankRecord
from lightning_dist.dryrun.agreement import disagreements
from lightning_dist.dryrun.roles import choose_ranks, coordinates, rank_at
from lightning_dist.parallel.mesh import ParallelDims

ROOT = Path(__file__).resolve().parents[1]
FULL_MATRIX_ONLY = pytest.mark.skipif(not FULL_MATRIX, reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1)")
CONFIGS = Path(__file__).resolve().parent / "dryrun_configs"


def test_roles_cover_every_stage_and_the_first_and_last_coordinate_of_tp_cp_and_ep():
    dims = ParallelDims(pp=16, dp_shard=16, tp=8)
    roles = choose_ranks(dims)
    assert len(roles) == 16 * 2
    assert [coordinates(dims, r) for r in roles if coordinates(dims, r)["pp"] == 3] == [
        {"pp": 3, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0},
        {"pp": 3, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 7},
    ]
    # a rank asked for comes with its pipeline (the stages exchange shapes)
    roles = choose_ranks(dims, [713])
    assert roles[713] == "pp5·dp_shard9·tp1"
    assert {r for r in roles if coordinates(dims, r)["dp_shard"] == 9} == {
        rank_at(dims, {"pp": s, "dp_shard": 9, "tp": 1}) for s in range(16)
    }
    assert coordinates(dims, 713) == {"pp": 5, "dp_replicate": 0, "dp_shard": 9, "cp": 0, "tp": 1}
    assert rank_at(dims, coordinates(dims, 713)) == 713
    assert len(choose_ranks(ParallelDims(dp_shard=32, cp=4, tp=8))) == 3
    ep = choose_ranks(ParallelDims(dp_shard=8, cp=2, ep=4))
    assert any(name.endswith("ep3") for name in ep.values())
    with pytest.raises(ValueError, match="not a rank of a world of 2048"):
        choose_ranks(dims, [2048])


def _c(kind: str, group: tuple[int, ...], size: int, peer: int | None = None) -> Collective:
    return Collective(kind, group, size, "step", peer)


def test_agreement_names_the_group_position_and_rank_of_the_first_difference():
    tp, dp = (0, 1), (0, 2)
    a = RankRecord(0, "a", collectives=[_c("all_gather_into_tensor", dp, 64), _c("all_reduce", tp, 8),
                                        _c("send", (0, 1), 16, peer=1)])  # fmt: skip
    b = RankRecord(1, "b", collectives=[_c("all_reduce", tp, 8), _c("recv", (0, 1), 16, peer=0)])
    c = RankRecord(2, "c", collectives=[_c("all_gather_into_tensor", dp, 128)])
    assert not disagreements([a, b])  # tp agrees; the send meets its receive
    found = disagreements([a, b, c])
    assert len(found) == 1
    d = found[0]
    assert (d.group, d.position, d.rank, d.reference_rank) == (dp, 0, 2, 0)
    assert "ranks 0 and 2 disagree on the group of 2 ranks [0, 2] at its collective #0" in d.describe()
    b_short = RankRecord(1, "b", collectives=[_c("all_reduce", tp, 8), _c("recv", (0, 1), 32, peer=0)])
    link = disagreements([a, b_short])[0]
    assert link.point_to_point and "point-to-point link 0 → 1" in link.describe()


def test_memory_sizes():
    assert memory_size("80GiB") == 80 * 2**30
    assert memory_size("80 GB") == 80 * 10**9
    assert memory_size("1e9") == 10**9
    with pytest.raises(Exception, match="not a memory size"):
        memory_size("80 parsecs")


def _dryrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CONFIGS), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "lightning_dist.cli", "dryrun", *args, "--json", str(tmp_path / "dry.json")]
    return subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_rank_dependent_branch_is_found_before_launch_with_its_rank_and_group(tmp_path):
    done = _dryrun(tmp_path, "--config", str(CONFIGS / "divergent.yaml"), "--world-size", "2", "--all-ranks")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / "dry.json").read_text())
    assert report["world_size"] == 2 and not report["agree"] and not report["passed"]
    first = report["first_disagreement"]
    assert first["group"] == [0, 1] and first["reference_rank"] == 0 and first["rank"] == 1
    assert (
        first["expected"]["kind"] != first["issued"]["kind"] or first["expected"]["bytes"] != first["issued"]["bytes"]
    )
    # every rank ran its setup and step, and its memory is split by category
    for rank in report["ranks"]:
        assert rank["error"] is None, rank["error"]
        assert set(rank["memory"]) == {"parameters", "buffers", "gradients", "optimizer", "activations"}
        assert rank["peak_bytes"] == sum(rank["memory"].values()) > 0
        assert rank["collectives"] and all(str(c["group"]) in report["groups"] for c in rank["collectives"])
    assert "ranks 0 and 1 disagree on the group of 2 ranks [0, 1]" in done.stdout


BAD_CONFIGURATIONS = {
    # a tensor-parallel plan the shapes cannot satisfy at that size: 4 heads over tp=8
    "tp_heads": (["--config", str(ROOT / "configs" / "tensor_parallel.yaml"), "--world-size", "1024",
                  "--trainer.strategy.init_args.tensor_parallel_size=8",
                  "--trainer.strategy.init_args.data_parallel_shard_size=128"],
                 ["attention heads = 4 is not divisible by tensor_parallel_size=8", "Choose a tensor_parallel_size"]),
    # experts not divisible: 4 experts over ep=8
    "ep_experts": (["--config", str(CONFIGS / "expert_parallel.yaml"), "--world-size", "1024",
                    "--trainer.strategy.init_args.expert_parallel_size=8"], ["expert_parallel_size=8"]),
    # a stage that reads another stage's module (the head reads the token embedding) under pp=2
    "cross_stage": (["--config", str(ROOT / "configs" / "pipeline.yaml"), "--world-size", "1024",
                     "--trainer.strategy.init_args.pipeline_parallel_size=2",
                     "--trainer.strategy.init_args.data_parallel_shard_size=512",
                     "--model.class_path=divergent_model.CrossStageGPT"], ["reads tok_emb.weight, which lives on pipeline stage 0", "Pass split="]),
}  # fmt: skip
DEFAULT_BAD = ["tp_heads"]


@pytest.mark.parametrize(
    "case",
    [c if c in DEFAULT_BAD or FULL_MATRIX else pytest.param(c, marks=FULL_MATRIX_ONLY) for c in BAD_CONFIGURATIONS],
)
def test_a_broken_configuration_at_scale_is_refused_before_any_rank_runs_with_the_fix(tmp_path, case):
    """What every rank would refuse (sizes the model does not divide, experts ep does not divide, a stage reading
    another's module) is found by the checks that need no rank: exit 2 in seconds, the cause once, and no summary
    about memory or agreement. Before: every rank ran and failed, the cause printed once per rank and layer, and
    the summary said the ranks agreed."""
    import time

    args, named = BAD_CONFIGURATIONS[case]
    start = time.monotonic()
    done = _dryrun(tmp_path, *args)
    seconds = time.monotonic() - start
    text = done.stdout + done.stderr
    assert done.returncode == 2 and "lightning-dist dryrun: error:" in done.stderr, text
    assert (
        seconds < 60 and "memory:" not in text and "collectives:" not in text and not (tmp_path / "dry.json").exists()
    )
    assert all(word in text for word in named), text
    assert text.count(named[0]) == 1, text  # one line for every layer with the same cause


def test_a_micro_batch_split_that_does_not_divide_ends_the_dry_run_before_any_rank(tmp_path):
    done = _dryrun(tmp_path, "--config", str(CONFIGS / "pipeline_1f1b.yaml"), "--world-size", "1024",
                   "--trainer.strategy.init_args.data_parallel_shard_size=256",
                   "--trainer.strategy.init_args.n_microbatches=6")  # fmt: skip
    assert done.returncode == 2 and "not divisible by n_microbatches=6" in done.stderr, done.stdout + done.stderr
    assert "memory:" not in done.stdout


def test_mesh_auto_is_planned_as_fit_plans_it_and_every_rank_runs_that_mesh(tmp_path):
    """``mesh: auto`` (configs/hybrid3d_auto.yaml) at 256 ranks: the planner's mesh, printed, for every rank; the
    ranks agree. Before: a traceback, "mesh='auto' is chosen for a model", exit 1."""
    done = _dryrun(tmp_path, "--config", str(ROOT / "configs" / "hybrid3d_auto.yaml"), "--world-size", "256",
                   "--num-nodes", "32")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "dry.json").read_text())
    assert report["agree"] and report["passed"] and all(r["error"] is None for r in report["ranks"])
    assert f"mesh='auto': the planner chose {report['mesh']}, as fit would" in done.stdout
    ranks = len(report["ranks"])  # progress on stderr, a plain line per update into a pipe, ending with all done
    assert re.search(rf"^dryrun: {ranks:,} ranks of {ranks:,} ranks \(100%\), \d+ s$", done.stderr, re.MULTILINE), (
        done.stderr
    )


def test_a_report_whose_ranks_failed_claims_nothing_they_did_not_show():
    from lightning_dist.dryrun.report import DryRunReport

    failed = [RankRecord(0, "tp0", error="ValueError: boom"), RankRecord(7, "tp7", error="ValueError: boom")]
    table = DryRunReport(16, 2, "tp=8", failed, [], device_memory=80 * 2**30).table()
    assert table.count("ValueError: boom") == 1 and "failed: as rank 0" in table
    assert "memory:" not in table and "collectives:" not in table and "no rank finished its step" in table
    some = [RankRecord(0, "tp0", memory={"total": 2**30}), RankRecord(7, "tp7", error="ValueError: boom")]
    table = DryRunReport(16, 2, "tp=8", some, [], device_memory=80 * 2**30).table()
    assert "memory: every rank that finished (1 of 2) within 80.0 GiB" in table
    assert "collectives: the ranks that finished (1 of 2) agree" in table


def test_pipeline_stages_send_bf16_activations_under_bf16_mixed_and_later_stages_hold_no_copy_of_earlier_blocks():
    """pp=4 × dp_shard=2, bf16-mixed: FSDP2 casts a stage's input to bf16 on arrival, so the stages before the last
    send bf16 (their roots keep the compute dtype; only the last one's output, the logits, is cast to fp32), and their
    gradients come back in bf16. A later stage's stand-ins for the blocks of earlier stages return one shared zero
    tensor per micro-batch, so the last stage holds no more activation memory than the first."""
    from lightning_dist.dryrun import dry_run

    args = [
        "--config",
        str(CONFIGS / "pipeline_1f1b.yaml"),
        "--trainer.precision=bf16-mixed",
        "--trainer.strategy.init_args.data_parallel_shard_size=2",
    ]
    report = dry_run(args, world_size=8)
    assert report.agree and all(r.error is None for r in report.ranks), [r.error for r in report.ranks]
    activation = 2 * 128 * 256  # a micro-batch of 2 (8 samples in 4), sequence 128, d_model 256
    p2p = {c.bytes for r in report.ranks for c in r.collectives if c.kind in ("send", "recv") and c.phase == "step"}
    assert {b for b in p2p if b >= activation} == {activation * 2}, p2p  # bf16, not fp32 (the rest: a few scalars)
    by_stage = {r.role.split("·")[0]: r.memory["activations"] for r in report.ranks}
    assert by_stage["pp3"] < 2 * by_stage["pp0"], by_stage


def test_each_collective_is_recorded_once_also_from_functions_run_on_real_tensors_with_fake_inputs():
    """Within the strategy's work the fake tensor mode records collectives for the counter (no counter mode of its
    own); a function run on real tensors (Lightning's ``self.log(..., sync_dist=True)``) gets the counter's mode back,
    and its collective on a fake tensor, which re-enters the fake mode, is still recorded once."""
    import torch
    import torch.distributed as dist

    from lightning_dist.dryrun.fake_values import DryRunTensorMode, on_real_tensors
    from lightning_dist.dryrun.fake_world import fake_rank
    from lightning_dist.profiling import CommCounter

    counter, mode = CommCounter(), DryRunTensorMode()
    with fake_rank(0, 2, 2), mode.counting(counter):
        loss = torch.ones(64, 64).sum(0)  # fake: 64 elements
        dist.all_reduce(loss)
        on_real_tensors(dist.all_reduce)(loss)
        on_real_tensors(dist.all_reduce)(torch.ones(3))
    assert [(r.op, r.tensor_bytes) for r in counter.records] == [("all_reduce", 256)] * 2 + [("all_reduce", 12)]


def test_a_view_made_without_the_fake_cache_is_the_view_torch_makes_and_autograd_and_memory_see_it_as_one():
    """Views and ``detach`` of a fake tensor skip FakeTensorMode's cache (``compat.fake_view``): the same sizes,
    offsets and storage as its own path (strides too, except a size-1 dimension's, where FakeTensorMode's reference
    kernel differs from the CPU and meta kernels and ours follows those), a gradient through them, and no memory."""
    import torch

    from lightning_dist.compat import fake_tensor_mode_class, storage_identity, view_ops
    from lightning_dist.dryrun.fake_values import DryRunTensorMode
    from lightning_dist.profiling.live_memory import LiveMemory

    def described(t: torch.Tensor) -> tuple:
        strides = tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride()))
        return t.shape, strides, t.storage_offset(), storage_identity(t), t.dtype, t.device, t.requires_grad

    aten = torch.ops.aten
    calls = {aten.view.default: ([6, 32],), aten._unsafe_view.default: ([3, 64],), aten.detach.default: (),
             aten.alias.default: (), aten.t.default: (), aten.transpose.int: (0, 1), aten.permute.default: ([1, 0],),
             aten.expand.default: ([2, 12, 16],), aten.as_strided.default: ([4, 4], [16, 1], 8),
             aten.select.int: (0, 3), aten.slice.Tensor: (1, 2, 10), aten.unsqueeze.default: (0,),
             aten.squeeze.dim: (0,), aten.squeeze.dims: ([0],), aten._reshape_alias.default: ([16, 12], [12, 1])}  # fmt: skip
    assert set(calls) == set(view_ops())
    mode = DryRunTensorMode()
    with mode:
        w = torch.zeros(12, 16)
        x = torch.zeros(12, 16, requires_grad=True)
    for func, rest in calls.items():
        with mode:
            fast = func(w, *rest)
        reference = fake_tensor_mode_class().dispatch(mode, func, (), (w, *rest), {})
        assert described(fast) == described(reference), func
        assert storage_identity(fast) == storage_identity(w), func
    with mode, LiveMemory([]) as memory:
        y = x.view(2, 96).t().detach()
    assert y.shape == (96, 2) and not y.requires_grad
    assert memory.peak == 12 * 16 * 4  # the storage the views share, once
    with mode:
        (x.view(6, 32).t() * 2).sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
