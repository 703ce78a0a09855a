"""A save stopped at any point of publishing loses no checkpoint: the next start (before Lightning resolves
``ckpt_path="last"``) or the next save of the same name publishes the newest complete version.

Fast cases stop a save in this process at each point of its publishing (an exception that nothing of ours catches,
so the files stay as a SIGKILL leaves them). The real case (``tests/scenarios/publish_kill_runs.py``) is one
process: a real SIGKILL between the two renames, each point frozen in an uninterrupted run, and a restart with
``ckpt_path="last"`` from each, compared with the uninterrupted losses.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from launch import max_abs_diff, run_scenarios
from torch import nn

from lightning_dist import DistributedCheckpointIO, FullStateCheckpointIO
from lightning_dist.checkpoint import model_state
from lightning_dist.checkpoint.layout import COMPLETE_MARKER, CheckpointError, read_metadata
from lightning_dist.checkpoint.recovery import finish_publish, interrupted_publishes
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.plugins import checkpoint_io

EXACT = 1e-7  # fp32, same process count: observed bitwise


class _Killed(BaseException):
    """Stands for SIGKILL: no handler of ours catches it, so the files stay as they are at that instant."""


def _checkpoint(step: int) -> dict:
    torch.manual_seed(step)
    return {"state_dict": model_state.model_state(nn.Linear(4, 3), full=False), "global_step": step}


def _stop_at(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Stop the next publish of a ``last.ckpt`` at ``point``: ``unfinished`` (before the completion marker),
    ``before`` (the first rename), ``between`` (the second) or ``after`` (both renames done)."""
    replace, write_marker, renames = os.replace, checkpoint_io.write_marker, [0]

    def stopping_replace(src, dst, **kwargs):
        renames[0] += 1
        if (point, renames[0]) in (("before", 1), ("between", 2)):
            raise _Killed(point)
        replace(src, dst, **kwargs)
        if (point, renames[0]) == ("after", 2):
            raise _Killed(point)

    def stopping_marker(folder, records):
        if point == "unfinished":
            raise _Killed(point)
        write_marker(folder, records)

    monkeypatch.setattr(os, "replace", stopping_replace)
    monkeypatch.setattr(checkpoint_io, "write_marker", stopping_marker)


def _hidden(folder: Path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in folder.iterdir() if p.name.startswith("."))


def _step(path: Path) -> int:
    return read_metadata(validate_checkpoint(path))["global_step"]


# (kill point, which step `last.ckpt` holds once recovered, the hidden entries the stop leaves)
POINTS = [
    ("unfinished", 1, [".last.ckpt.tmp"]),  # the write never finished: the previous version stays
    ("before", 2, [".last.ckpt.tmp"]),
    ("between", 2, [".last.ckpt.old", ".last.ckpt.tmp"]),  # and no last.ckpt at all
    ("after", 2, [".last.ckpt.old"]),
]


@pytest.mark.parametrize(("point", "recovered_step", "left"), POINTS, ids=[p[0] for p in POINTS])
def test_a_publish_stopped_at_any_point_recovers_the_newest_complete_checkpoint(
    tmp_path, monkeypatch, point, recovered_step, left
):
    last = tmp_path / "last.ckpt"
    DistributedCheckpointIO().save_checkpoint(_checkpoint(1), last)
    with monkeypatch.context() as patch:
        _stop_at(patch, point)
        with pytest.raises(_Killed):
            DistributedCheckpointIO().save_checkpoint(_checkpoint(2), last)
    assert _hidden(tmp_path) == left and last.exists() == (point != "between")
    for item in interrupted_publishes(tmp_path):  # what rank 0 does before launch
        finish_publish(item)
    assert _step(last) == recovered_step
    assert _hidden(tmp_path) == ([".last.ckpt.tmp"] if point == "unfinished" else [])
    DistributedCheckpointIO().save_checkpoint(_checkpoint(3), last)  # the next save removes an unfinished write
    assert _step(last) == 3 and _hidden(tmp_path) == []


def test_a_full_state_file_stopped_before_its_rename_is_published(tmp_path, monkeypatch):
    last = tmp_path / "last.ckpt"
    FullStateCheckpointIO().save_checkpoint(_checkpoint(1), last)
    with monkeypatch.context() as patch:
        _stop_at(patch, "before")
        with pytest.raises(_Killed):
            FullStateCheckpointIO().save_checkpoint(_checkpoint(2), last)
    truncated = tmp_path / ".last.ckpt.tmp-0123456789ab"  # a write stopped midway: never published
    truncated.write_bytes(last.read_bytes()[:500])
    for item in interrupted_publishes(tmp_path):
        finish_publish(item)
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert _hidden(tmp_path) == [".last.ckpt.tmp"] and truncated.exists()
    FullStateCheckpointIO().save_checkpoint(_checkpoint(3), last)
    assert _hidden(tmp_path) == []


def test_an_explicit_ckpt_path_stopped_between_the_renames_is_the_new_checkpoint(tmp_path, monkeypatch):
    """Before, the version set aside (the older one) was renamed back, and the complete new one later deleted."""
    last = tmp_path / "last.ckpt"
    DistributedCheckpointIO().save_checkpoint(_checkpoint(1), last)
    with monkeypatch.context() as patch:
        _stop_at(patch, "between")
        with pytest.raises(_Killed):
            DistributedCheckpointIO().save_checkpoint(_checkpoint(2), last)
    assert validate_checkpoint(last) == last and _step(last) == 2


def test_a_save_never_deletes_a_complete_checkpoint_left_under_a_hidden_name(tmp_path, monkeypatch):
    """The next save of the same name first publishes it (then replaces it, as any save of that name does); a
    complete one older than the checkpoint in place is left alone; nothing is done over what is not ours."""
    last = tmp_path / "last.ckpt"
    DistributedCheckpointIO().save_checkpoint(_checkpoint(1), last)
    with monkeypatch.context() as patch:
        _stop_at(patch, "between")
        with pytest.raises(_Killed):
            DistributedCheckpointIO().save_checkpoint(_checkpoint(2), last)
    stopped = next(tmp_path.glob(".last.ckpt.tmp-*"))

    def killed_write(*args, **kwargs):
        raise _Killed("stopped in its write")

    with monkeypatch.context() as patch:  # a new save of last.ckpt, stopped as soon as it starts writing
        patch.setattr(checkpoint_io.dcp, "save", killed_write)
        with pytest.raises(_Killed):
            DistributedCheckpointIO().save_checkpoint(_checkpoint(3), last)
    assert _step(last) == 2 and not stopped.exists()  # it was published before the new save wrote anything

    older = tmp_path / ".last.ckpt.tmp-00000000000a"
    DistributedCheckpointIO().save_checkpoint(_checkpoint(0), tmp_path / "spare.ckpt")
    os.replace(tmp_path / "spare.ckpt", older)
    os.utime(older / COMPLETE_MARKER, (0, 0))  # saved long before the last.ckpt in place
    assert interrupted_publishes(tmp_path) == []
    DistributedCheckpointIO().save_checkpoint(_checkpoint(4), last)
    assert older.is_dir() and _step(last) == 4

    users = tmp_path / "users.ckpt"
    users.write_text("not ours")
    os.replace(older, tmp_path / ".users.ckpt.tmp-00000000000b")
    assert interrupted_publishes(tmp_path) == [] and users.read_text() == "not ours"


def test_other_ranks_wait_until_rank_zero_has_published(tmp_path, monkeypatch):
    """Under torchrun every rank runs the checks before launch; rank 0 publishes, the others list the folder only
    once it has, so that every rank resolves ckpt_path="last" to the same checkpoint."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dist.strategies.lifecycle import interrupted_saves

    last = tmp_path / "last.ckpt"
    DistributedCheckpointIO().save_checkpoint(_checkpoint(1), last)
    with monkeypatch.context() as patch:
        _stop_at(patch, "between")
        with pytest.raises(_Killed):
            DistributedCheckpointIO().save_checkpoint(_checkpoint(2), last)
    trainer = L.Trainer(callbacks=[ModelCheckpoint(dirpath=tmp_path)], logger=False, accelerator="cpu", devices=1)

    def rank_zero() -> None:
        time.sleep(0.5)
        interrupted_saves.recover_checkpoint_folders(trainer, 0, "last")

    threading.Thread(target=rank_zero).start()
    start = time.monotonic()
    interrupted_saves.recover_checkpoint_folders(trainer, 1, "last")
    assert time.monotonic() - start >= 0.4 and _step(last) == 2

    with monkeypatch.context() as patch:
        _stop_at(patch, "between")
        with pytest.raises(_Killed):
            DistributedCheckpointIO().save_checkpoint(_checkpoint(3), last)
    monkeypatch.setattr(interrupted_saves, "WAIT_SECONDS", 0.3)
    with pytest.raises(CheckpointError, match="Rank 0 did not finish publishing"):
        interrupted_saves.recover_checkpoint_folders(trainer, 1, "last")


# ------------------------------------------------------------------------------------------ real processes
@pytest.fixture(scope="module")
def kills(tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("publish_kills")
    return run_scenarios("publish_kill_runs.py", 1, workdir, ["kill_matrix"])["kill_matrix"]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before", "between", "after", "killed"])
def test_a_restart_with_last_resumes_from_the_newest_complete_checkpoint(kills, point):
    """The step-4 save of last.ckpt stopped before, between or after its renames (``killed``: a real SIGKILL
    between them): ``ckpt_path="last"`` resumes at step 4 and trains steps 5-6 as the uninterrupted run did."""
    if point == "killed":
        killed, frozen = kills["sigkill"], kills["between"]["listing_before"]
        assert killed["signal"] == 9 and [n.split("-")[0] for n in killed["listing"]] == [
            n.split("-")[0] for n in frozen
        ]
    run, reference = kills[point], kills["reference"]["losses"]
    assert run["global_step"] == 6 and len(run["losses"]) == 2, run
    assert max_abs_diff(run["losses"], reference[4:]) <= EXACT
    assert [name for name in run["listing_after"] if name.startswith(".")] == []
    assert run["listing_after"] == ["last.ckpt", "step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]


@pytest.mark.slow
def test_a_restart_without_a_complete_last_says_so_and_trains_from_scratch(kills):
    run = kills["unfinished"]
    assert max_abs_diff(run["losses"], kills["reference"]["losses"]) <= EXACT
    said = next(w for w in run["warnings"] if w.startswith('ckpt_path="last": there is no complete `last`'))
    assert "is incomplete and is deleted by the next save), so training starts from scratch" in said
    assert said.endswith("/ckpts/step=2.ckpt' to resume from it instead.")


@pytest.mark.slow
def test_a_fresh_run_in_the_folder_keeps_the_complete_checkpoint(kills):
    """Published before launch, ``last.ckpt`` (step 4) is there for Lightning to see, so a new run saves
    ``last-v1.ckpt`` beside it instead of deleting it as an unfinished save."""
    run = kills["fresh_run"]
    assert run["last_step"] == 4
    assert run["listing_after"] == ["last-v1.ckpt", "last.ckpt", "step=2-v1.ckpt", "step=2.ckpt", "step=4.ckpt"]
