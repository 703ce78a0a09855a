"""A finished 2-process fit exits with code 0, every time: schedulers read any other code as a failed job."""

from __future__ import annotations

import sys

import pytest
from launch import run_training_command

pytestmark = pytest.mark.slow

RUNS = 3


def test_repeated_two_process_fits_all_exit_cleanly(tmp_path):
    cmd = [sys.executable, "examples/train.py", "--strategy", "fsdp2", "--devices", "2", "--accelerator", "cpu"]
    for run in range(RUNS):
        out = run_training_command([*cmd, "--max-steps", "2", "--seed", str(run)], tmp_path, max_steps=2)
        assert "terminate called" not in out, f"run {run}:\n{out[-3000:]}"


def test_an_nn_transformer_model_trains_without_fsdp_view_warnings(tmp_path):
    """Lightning's demo Transformer: FSDP2 warned on every forward that the unit outside the blocks returned a view."""
    cmd = [sys.executable, "tests/scenarios/demo_transformer.py", "fsdp2", "2"]
    out = run_training_command(cmd, tmp_path, max_steps=3)
    assert "returned a view tensor" not in out
