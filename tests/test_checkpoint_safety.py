"""Saves and tools replace only our own complete checkpoints; anything else at the target is refused before a byte
is written, and a sentinel file of the user's survives every refusal (no process launches here; the real Trainer
cases run in tests/test_checkpoint_migration.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_dist import AsyncDistributedCheckpointIO, CheckpointError, DistributedCheckpointIO, FullStateCheckpointIO
from lightning_dist.checkpoint import model_state
from lightning_dist.checkpoint.consolidate import load_full_checkpoint, save_safetensors, save_torch
from lightning_dist.checkpoint.layout import check_replaceable, validate_checkpoint
from lightning_dist.commands import run_tool

SENTINEL = "my notes, not a checkpoint\n"
PLUGINS = [DistributedCheckpointIO, AsyncDistributedCheckpointIO, FullStateCheckpointIO]


def _checkpoint(step: int = 1) -> dict:
    torch.manual_seed(step)
    model = nn.Linear(4, 3)
    return {"state_dict": model_state.model_state(model, full=False), "global_step": step}


def _save(io_cls: type, path: Path, step: int = 1) -> None:
    io = io_cls()
    try:
        io.save_checkpoint(_checkpoint(step), path)
    finally:
        io.teardown() if isinstance(io, AsyncDistributedCheckpointIO) else None


def _user_folder(path: Path) -> Path:
    path.mkdir()
    (path / "notes.txt").write_text(SENTINEL)
    (path / "old-run.ckpt").write_bytes(b"whatever the user keeps here")
    return path


def _listing(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


@pytest.mark.parametrize("io_cls", PLUGINS)
def test_a_save_onto_a_users_directory_is_refused_and_everything_survives(tmp_path, io_cls):
    target = _user_folder(tmp_path / "ckpts")
    before = _listing(target)
    with pytest.raises(CheckpointError) as err:
        _save(io_cls, target)
    assert str(err.value) == (
        f"Refusing to write a checkpoint to {str(target)!r}: it is a directory that is not a lightning_dist checkpoint"
        " (2 entries: notes.txt, old-run.ckpt). A save replaces only a complete lightning_dist checkpoint of the same"
        " name. Choose another path, or move what is there away yourself."
    )
    assert (target / "notes.txt").read_text() == SENTINEL
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt", "old-run.ckpt"]
    assert _listing(target) == before  # no temporary left beside it either


@pytest.mark.parametrize("io_cls", PLUGINS)
def test_a_save_onto_a_users_file_is_refused(tmp_path, io_cls):
    target = tmp_path / "model.ckpt"
    target.write_text(SENTINEL)
    with pytest.raises(CheckpointError, match=r"it is a file that is not a lightning_dist checkpoint \(27 bytes\)"):
        _save(io_cls, target)
    assert target.read_text() == SENTINEL and _listing(target) == ["model.ckpt"]


@pytest.mark.parametrize("io_cls", PLUGINS)
def test_a_save_onto_a_link_or_an_empty_directory_is_refused(tmp_path, io_cls):
    sentinel = tmp_path / "notes.txt"
    sentinel.write_text(SENTINEL)
    link = tmp_path / "last.ckpt"
    link.symlink_to(sentinel)
    with pytest.raises(CheckpointError, match="it is a symbolic link"):
        _save(io_cls, link)
    assert link.is_symlink() and sentinel.read_text() == SENTINEL
    empty = tmp_path / "empty.ckpt"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="it is an empty directory"):
        _save(io_cls, empty)


@pytest.mark.parametrize("first", PLUGINS)
@pytest.mark.parametrize("second", PLUGINS)
def test_our_own_checkpoint_of_the_same_name_is_replaced(tmp_path, first, second):
    target = tmp_path / "last.ckpt"
    _save(first, target, step=1)
    _save(second, target, step=2)
    assert load_full_checkpoint(validate_checkpoint(target))["global_step"] == 2
    assert _listing(target) == ["last.ckpt"]


def test_a_checkpoint_of_another_tool_is_not_replaced(tmp_path):
    target = tmp_path / "step=3.ckpt"
    _save(DistributedCheckpointIO, target)
    meta = torch.load(target / "meta.pt", weights_only=False)
    del meta["lightning_dist"]
    torch.save(meta, target / "meta.pt")  # now laid out exactly like Lightning's ModelParallelStrategy's
    (target / "COMPLETE").unlink()
    validate_checkpoint(target)  # it loads...
    with pytest.raises(CheckpointError, match="written by another tool"):
        check_replaceable(target)  # ...but is never overwritten


@pytest.mark.parametrize("io_cls", [DistributedCheckpointIO, AsyncDistributedCheckpointIO])
def test_model_checkpoint_deletes_only_our_checkpoints(tmp_path, io_cls):
    users = _user_folder(tmp_path / "epoch=0.ckpt")
    ours = tmp_path / "epoch=1.ckpt"
    _save(io_cls, ours)
    io = io_cls()
    with pytest.warns(UserWarning, match="Not deleting .*epoch=0.ckpt.*lightning_dist deletes only its own"):
        io.remove_checkpoint(users)
    io.remove_checkpoint(ours)
    io.teardown()
    assert (users / "notes.txt").read_text() == SENTINEL and not ours.exists()


def test_consolidate_never_replaces_a_directory_or_a_users_file(tmp_path, capsys):
    source = tmp_path / "last.ckpt"
    _save(DistributedCheckpointIO, source)
    exports = _user_folder(tmp_path / "exports")
    with pytest.raises(SystemExit):
        run_tool("consolidate", [str(source), str(exports)])
    assert "Refusing to write a checkpoint to" in capsys.readouterr().err
    assert (exports / "notes.txt").read_text() == SENTINEL and len(list(exports.iterdir())) == 2
    users_file = tmp_path / "model.safetensors"
    users_file.write_text(SENTINEL)
    with pytest.raises(SystemExit):
        run_tool("consolidate", [str(source), str(users_file)])
    assert "Exports replace only an earlier safetensors export" in capsys.readouterr().err
    assert users_file.read_text() == SENTINEL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports", "last.ckpt", "model.safetensors"]


def test_consolidate_replaces_its_own_earlier_exports(tmp_path):
    source = tmp_path / "last.ckpt"
    _save(DistributedCheckpointIO, source)
    checkpoint = load_full_checkpoint(source)
    for out, save in ((tmp_path / "model.ckpt", save_torch), (tmp_path / "model.safetensors", save_safetensors)):
        save(checkpoint, out)
        first = os.stat(out).st_ino
        save(checkpoint, out)
        assert os.stat(out).st_ino != first  # a new file was published over the old one


@pytest.mark.parametrize("content", [SENTINEL.encode(), None])
def test_consolidate_writes_nothing_for_an_input_that_is_not_a_checkpoint(tmp_path, capsys, content):
    source = tmp_path / "not_a_checkpoint.ckpt"
    if content is None:
        torch.save({"weights": torch.ones(2)}, source)  # a torch file, but no Lightning checkpoint
    else:
        source.write_bytes(content)
    out = tmp_path / "out.ckpt"
    with pytest.raises(SystemExit):
        run_tool("consolidate", [str(source), str(out)])
    err = capsys.readouterr().err
    assert "cannot be read as a torch checkpoint" in err or "is not a Lightning checkpoint" in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["not_a_checkpoint.ckpt"]
