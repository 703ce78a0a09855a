"""Parameters that several ranks hold a copy of stay bitwise identical, seed or no seed (as DDP guarantees)."""

from __future__ import annotations

import pytest
from launch import run_scenarios

pytestmark = pytest.mark.slow


def test_replicated_copies_are_equal_without_a_seed_and_stay_equal(tmp_path):
    scenarios = ["tp_unseeded", "tp_100_steps", "hsdp_unseeded", "fsdp2_buffer_unseeded"]
    result = run_scenarios("replica_runs.py", 2, tmp_path, scenarios)
    for name, axis in (("tp_unseeded", "tp"), ("hsdp_unseeded", "dp_replicate"), ("fsdp2_buffer_unseeded", "dp_shard")):
        run = result[name]
        assert run["init_checksums"][0] != run["init_checksums"][1]  # each rank initialized its own values
        if name != "fsdp2_buffer_unseeded":  # there only the buffer is whole on every rank (the log line is checked)
            assert run["at_start"] == 0.0 and run["at_end"] == 0.0, run
        # the log line names the axes (it once said "made equal across  (from the first rank)" for dp_shard)
        assert [line.split(" made equal across ")[1] for line in run["equalized"]] == [f"{axis} (from the first rank)"]
    long = result["tp_100_steps"]  # fp32: before the gradients were averaged, LayerNorm biases drifted by 5e-10
    assert long["at_start"] == 0.0 and long["at_end"] == 0.0, long
