"""``on_nonfinite``: a NaN loss on rank 1 at global step 2 (2 processes, fsdp2, fp64)."""

from __future__ import annotations

import pytest
from launch import run_scenarios

from lightning_dist import FSDP2Strategy


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_scenarios("nonfinite_runs.py", 2, tmp_path_factory.mktemp("nonfinite"), ["skip", "stop"])


WHERE = "at global step 2 (epoch 0, batch 2)"
WHAT = "a non-finite loss on rank 1 and non-finite gradients on rank 0, 1"


@pytest.mark.slow
def test_skip_leaves_the_parameters_of_that_step_untouched_on_every_rank_and_trains_on(runs):
    skip = runs["skip"]
    before, at, after = skip["changes"]
    assert at == 0.0 and before > 0 and after > 0
    assert skip["skipped"] == 1 and skip["finite_after"]
    assert skip["warnings"] == [f"Skipped the optimizer step {WHERE} on every rank: {WHAT} (on_nonfinite='skip')."]


@pytest.mark.slow
def test_stop_raises_the_same_message_on_every_rank(runs):
    first, second = runs["stop"]["messages"]
    assert first == second and first.startswith(f"Training stopped {WHERE}: {WHAT} (on_nonfinite='stop').")


def test_an_unknown_mode_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"on_nonfinite='nan' is not one of \['ignore', 'skip', 'stop'\]"):
        FSDP2Strategy(on_nonfinite="nan")
