"""The scenario launch (``tests/launch.py:run_scenarios``) forks each rank from one server that has imported torch
and Lightning: each rank must still look like the process Lightning's launcher would start."""

from __future__ import annotations

import os

import pytest
from launch import run_scenarios

from benchmarks.common.scenarios import fork_launch_enabled

pytestmark = pytest.mark.skipif(not fork_launch_enabled(), reason="LIGHTNING_DIST_FORK_LAUNCH=0: ranks are new Pythons")


def test_each_forked_rank_has_its_launcher_variables_its_own_process_and_fresh_random_state(tmp_path):
    ranks = run_scenarios("launch_probe.py", 2, tmp_path, ["seen"], env={"PROBE": "yes"})["seen"]
    assert [r["variables"]["LOCAL_RANK"] for r in ranks] == ["0", "1"]
    assert {r["variables"]["WORLD_SIZE"] for r in ranks} == {"2"} and {r["variables"]["NODE_RANK"] for r in ranks} == {
        "0"
    }
    assert {r["variables"]["PROBE"] for r in ranks} == {"yes"}  # the caller's variables reach every rank
    assert len({r["pid"] for r in ranks} | {os.getpid()}) == 3
    assert ranks[0]["random"] != ranks[1]["random"]  # Python's generator reseeded, as a new interpreter's is
    expected_threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // 2))  # as the launch sets it
    assert [r["threads"] for r in ranks] == [expected_threads] * 2
    assert {r["main"] for r in ranks} == {"launch_probe.py"} and {r["argv"][0] for r in ranks} == {"--devices"}
    assert {r["cwd"] for r in ranks} == {str(tmp_path)} and {r["script_dir"] for r in ranks} == {
        os.path.join(os.path.dirname(__file__), "scenarios")
    }


def test_a_rank_that_fails_ends_the_launch_with_its_output(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)rank 1 \(status 1\).*ValueError: rank one fails on purpose"):
        run_scenarios("launch_probe.py", 2, tmp_path, ["fails_on_rank_one"], timeout=120)


def test_a_script_that_starts_its_own_ranks_is_started_once():
    """The pure-PyTorch harness spawns its ranks itself: forked N times, it would run N copies of the whole launch."""
    from launch import SCENARIO_DIR

    from benchmarks.common.scenarios import starts_its_own_processes

    own = {p.name for p in SCENARIO_DIR.glob("*.py") if starts_its_own_processes(p)}
    assert {"cp_attention_runs.py", "expert_parallel_core_runs.py", "pretrained_runs.py"} <= own
    assert not own & {"fsdp2_runs.py", "hybrid3d_runs.py", "launch_probe.py"}
