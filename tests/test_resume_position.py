"""A resumed run continues exactly where the uninterrupted run is, for every way a checkpoint is made.

Lightning's injected DistributedSampler shuffles each epoch differently, so a resume that starts in the wrong epoch,
or at the wrong batch, trains on other samples. One 2-rank launch runs, per strategy, the uninterrupted reference
(12 steps, 3 epochs of 4 batches), fits stopped by max_steps mid-epoch, max_steps at the epoch boundary and
max_epochs (each then calls ``trainer.save_checkpoint``), and the resume from each checkpoint: those, ModelCheckpoint
every 3 and every 4 steps, at train-epoch end (also of an epoch cut short by max_steps) and at validation end.
The losses of the resumed steps must equal the reference's exactly (same world size, fp32: bitwise).

fsdp2 runs all 12 resumes; pipeline and tensor_parallel (the same code path) one of each kind. Before the fix, 7 of
fsdp2's 12 resumes and 4 of 5 on the others differed: Lightning counts an epoch as processed when fit stops mid-epoch
and at epoch end, so they resumed one epoch too far (an epoch cut short) or ran the next epoch empty. Only Lightning's
own batch-end saves and two resumes told to stop by max_epochs (not iteration-based) were right.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from launch import FULL_MATRIX, run_scenarios

from lightning_dist.checkpoint.layout import PROVENANCE_KEY, read_metadata

sys.path.insert(0, str(Path(__file__).parent / "scenarios"))
from resume_position_runs import CASES, RESUMES, STEPS, STRATEGIES  # type: ignore[import-not-found]

sys.path.remove(str(Path(__file__).parent / "scenarios"))
# tensor_parallel only in the full matrix (tests/launch.py): the loop position is the strategies' shared lifecycle,
# run here under fsdp2 (every case) and pipeline (a subset)
RUN = [s for s in STRATEGIES if FULL_MATRIX or s != "tensor_parallel"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("resume_position")


@pytest.fixture(scope="module")
def runs(workdir):
    return run_scenarios("resume_position_runs.py", 2, workdir, RUN, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", RUN)
def test_stopped_fits_follow_the_reference(runs, strategy):
    reference = runs[strategy]["reference"]
    assert reference["global_step"] == STEPS and [s[:2] for s in reference["steps"]] == [
        [epoch, batch] for epoch in range(3) for batch in range(4)
    ]
    for name in {"stopped_mid", "stopped_boundary", "stopped_epochs"} & set(runs[strategy]):
        run = runs[strategy][name]
        assert run["losses"] == reference["losses"][: len(run["losses"])], name


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "resume"), [(s, r) for s, cases in CASES.items() if s in RUN for r in cases])
def test_resume_continues_the_uninterrupted_run_exactly(runs, strategy, resume):
    reference = runs[strategy]["reference"]
    run = runs[strategy][f"resume_{resume}"]
    step = RESUMES[resume][1]
    assert run["global_step"] == STEPS
    # the same batches (epoch, index and contents as Lightning reports them) ...
    assert run["steps"] == reference["steps"][step:]
    # ... and the same losses, bitwise
    assert run["losses"] == reference["losses"][step:]
    assert run["warnings"] == []  # no "cannot skip" and no Lightning "not resumable" warning


@pytest.mark.slow
def test_a_checkpoint_saved_after_fit_records_the_true_position(runs, workdir):
    def position(path: str) -> tuple[int, dict]:
        meta = read_metadata(workdir / "fsdp2" / path, True)
        return meta["epoch"], meta[PROVENANCE_KEY]["data_position"]

    epoch, recorded = position("stopped_mid/after_fit.ckpt")  # 3 of epoch 0's 4 batches
    assert (epoch, recorded["epoch"], recorded["batches_processed"]) == (0, 0, 3)
    for path in ("stopped_boundary/after_fit.ckpt", "stopped_epochs/after_fit.ckpt"):  # epoch 0 finished
        epoch, recorded = position(path)
        assert (epoch, recorded["epoch"], recorded["batches_processed"]) == (1, 1, 0)


# ---------------------------------------------------------------------------------------------- fast, in process
def _loops(epoch: list[int], batch: list[int], last: bool) -> dict:
    """A fit loop's counters as Lightning 2.6.6 saves them (ready, started, processed, completed)."""

    def progress(counts: list[int]) -> dict:
        values = dict(zip(("ready", "started", "processed", "completed"), counts))
        return {"total": dict(values), "current": dict(values)}

    return {
        "fit_loop": {
            "epoch_progress": progress(epoch),
            "epoch_loop.batch_progress": {**progress(batch), "is_last_batch": last},
            "epoch_loop.scheduler_progress": progress(batch),
            "epoch_loop.val_loop.batch_progress": {**progress([2, 2, 2, 2]), "is_last_batch": True},
        }
    }


# (epoch counters, batch counters, is_last_batch) observed with 4 batches per epoch → the true position
SAVED_STATES = {
    "after fit, max_steps=3": ([1, 1, 1, 1], [3, 3, 3, 3], False, (0, 3)),
    "after fit, max_steps=4": ([1, 1, 1, 1], [4, 4, 4, 4], True, (1, 0)),
    "train epoch end": ([1, 1, 1, 0], [4, 4, 4, 4], True, (1, 0)),
    "validation end of epoch 1": ([2, 2, 2, 1], [4, 4, 4, 4], True, (2, 0)),
    "every 3 steps (batch end)": ([1, 1, 0, 0], [3, 3, 3, 2], False, (0, 3)),
    "every 4 steps (last batch end)": ([1, 1, 0, 0], [4, 4, 4, 3], True, (1, 0)),
}


@pytest.mark.parametrize("state", list(SAVED_STATES))
def test_loop_counters_settle_to_the_true_position(state):
    from lightning_dist.strategies.lifecycle.loop_position import settle_fit_loop

    epoch, batch, last, expected = SAVED_STATES[state]
    loops = _loops(epoch, batch, last)
    assert settle_fit_loop(loops, 4) == expected
    assert settle_fit_loop(loops) == expected  # at load time (is_last_batch tells), and settling twice is a no-op
    counters = loops["fit_loop"]["epoch_progress"]["current"]
    if epoch[2] < epoch[0]:  # saved mid-epoch (at a batch end): Lightning resumes these itself, left as they are
        assert loops == _loops(epoch, batch, last)
    elif expected[1]:  # cut short: the epoch counters name the epoch in progress, as in a batch-end save
        assert counters["processed"] == counters["completed"] == expected[0] == counters["ready"] - 1
    else:  # finished: the next epoch starts fresh
        assert counters["completed"] == counters["processed"] == expected[0]
        assert loops["fit_loop"]["epoch_loop.batch_progress"]["current"]["processed"] == 0


def test_a_position_recorded_before_the_fix_is_corrected_from_the_loop_counters():
    from lightning_dist.strategies.lifecycle.data_position import resume_position

    recorded = {"epoch": 1, "batches_processed": 3, "batches_per_epoch": 4, "batch_sizes": [4], "replicas": 2}
    checkpoint = {"loops": _loops([1, 1, 1, 1], [3, 3, 3, 3], False)}
    position = resume_position(checkpoint, recorded)
    assert (position["epoch"], position["batches_processed"], position["replicas"]) == (0, 3, 2)


def test_a_mid_epoch_checkpoint_without_a_recorded_position_warns():
    from torch.utils.data import DataLoader

    from lightning_dist.strategies.lifecycle.data_position import resume_position, skip_trained_batches

    checkpoint = {"loops": _loops([1, 1, 0, 0], [3, 3, 3, 2], False)}  # saved by plain Lightning, mid-epoch
    position = resume_position(checkpoint, None)
    with pytest.warns(UserWarning, match="cannot skip the 3 batches.*records no data position"):
        assert not skip_trained_batches(DataLoader(list(range(32)), batch_size=4), position, index=0, replicas=2)
