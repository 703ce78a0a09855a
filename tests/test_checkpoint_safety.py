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
from lightning_dist.checkpoint.export_target import check_export_target
from lightning_dist.checkpoint.layout import check_replaceable
from lightning_dist.checkpoint.validation import validate_checkpoint
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
    assert f"Refusing to write {str(exports)!r}: it is a directory (2 entries" in capsys.readouterr().err
    assert (exports / "notes.txt").read_text() == SENTINEL and len(list(exports.iterdir())) == 2
    users_file = tmp_path / "model.safetensors"
    users_file.write_text(SENTINEL)
    with pytest.raises(SystemExit):
        run_tool("consolidate", [str(source), str(users_file)])
    assert "it is a file that is not an export of lightning_dist (27 bytes)" in capsys.readouterr().err
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


# ------------------------------------------------------------------------------- what an export may replace
def _contents(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target."""
    return {
        str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def _lightning_single_file(path: Path) -> None:
    """What plain Lightning's ``trainer.save_checkpoint`` writes (no lightning_dist entry)."""
    torch.save({**_checkpoint(), "loops": {"fit_loop": {}}, "pytorch-lightning_version": "2.6.6"}, path)


def _lightning_sharded(path: Path) -> None:
    """A sharded folder as Lightning's ModelParallelStrategy writes it (no COMPLETE marker, no provenance)."""
    _save(DistributedCheckpointIO, path)
    meta = torch.load(path / "meta.pt", weights_only=True)
    del meta["lightning_dist"]
    torch.save(meta, path / "meta.pt")
    (path / "COMPLETE").unlink()


def _unfinished_save(path: Path) -> None:
    _save(DistributedCheckpointIO, path)
    (path / "COMPLETE").unlink()


TRAINING_CHECKPOINTS = {
    "sharded, ours": (lambda p: _save(DistributedCheckpointIO, p), "a sharded training checkpoint"),
    "single file, ours": (lambda p: _save(FullStateCheckpointIO, p), "a training checkpoint"),
    "sharded, Lightning's": (_lightning_sharded, "a sharded training checkpoint"),
    "single file, Lightning's": (_lightning_single_file, "a training checkpoint"),
    "unfinished sharded save": (_unfinished_save, "a sharded training checkpoint"),
}


@pytest.mark.parametrize("target", list(TRAINING_CHECKPOINTS))
def test_consolidate_never_replaces_a_training_checkpoint(tmp_path, capsys, target):
    """``lightning-dist consolidate step=100.ckpt step=200.ckpt`` (the arguments swapped) leaves both as they were."""
    source = tmp_path / "step=100.ckpt"
    _save(DistributedCheckpointIO, source, step=3)
    build, kind = TRAINING_CHECKPOINTS[target]
    out = tmp_path / "step=200.ckpt"
    build(out)
    before = _contents(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_tool("consolidate", [str(source), str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"Refusing to write {str(out)!r}: it is {kind}" in err, err
    assert "lightning-dist consolidate CHECKPOINT OUT" in err  # the order of the arguments
    assert _contents(tmp_path) == before


@pytest.mark.parametrize("how", ["the same path", "a link to it", "a file inside it", "an export onto itself"])
def test_consolidate_never_writes_over_or_into_its_input(tmp_path, capsys, how):
    source = tmp_path / "step=6.ckpt"
    _save(DistributedCheckpointIO, source, step=6)
    extra: list[str] = []
    if how == "a link to it":
        (tmp_path / "last.ckpt").symlink_to(source.name)
        source, out = tmp_path / "last.ckpt", source
    elif how == "a file inside it":
        out = source / "model.ckpt"
    elif how == "an export onto itself":
        run_tool("consolidate", [str(source), str(tmp_path / "model.ckpt")])
        source = out = tmp_path / "model.ckpt"
        extra = ["--weights-only"]
    else:
        out = source
    capsys.readouterr()
    before = _contents(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        run_tool("consolidate", [str(source), str(out), *extra])
    assert exit_.value.code == 2
    expected = (
        "it is inside the checkpoint being read" if how == "a file inside it" else "it is the checkpoint being read"
    )
    assert f"Refusing to write {str(out)!r}: {expected}" in capsys.readouterr().err
    assert _contents(tmp_path) == before


def test_an_export_replaces_only_files_marked_as_exports(tmp_path):
    """The rule both export commands share: a torch export or a safetensors export of ours may be replaced, in
    either format; the same data saved by a training run may not."""
    source = tmp_path / "last.ckpt"
    _save(DistributedCheckpointIO, source)
    checkpoint = load_full_checkpoint(source)
    torch_out, safetensors_out = tmp_path / "model.ckpt", tmp_path / "model.safetensors"
    save_torch(checkpoint, torch_out)
    save_safetensors(checkpoint, safetensors_out)
    check_export_target(torch_out, source)
    check_export_target(safetensors_out, source)
    save_safetensors(checkpoint, torch_out)  # a safetensors export over a torch export of ours
    save_torch(checkpoint, safetensors_out)
    trained = tmp_path / "trained.ckpt"
    FullStateCheckpointIO().save_checkpoint(checkpoint, trained)  # the very same content, saved as a checkpoint
    with pytest.raises(CheckpointError, match=r"it is a training checkpoint \(a single file with a lightning_dist"):
        save_torch(checkpoint, trained)
    with pytest.raises(CheckpointError, match="it is a training checkpoint"):
        check_export_target(trained)
