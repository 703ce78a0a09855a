"""A save that fails (a full disk, an I/O error, a refused rename) raises a ``CheckpointError`` whose first line
names the checkpoint and the cause, removes its partial files and leaves the previous checkpoint as it was, for the
three plugins. No process launches: one rank writes, as every rank does in its part of a save.

The full disk is real where the tests run as root (a 96 KiB tmpfs); the other failures are injected where torch
or the operating system would raise them.
"""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_dist import AsyncDistributedCheckpointIO, CheckpointError, DistributedCheckpointIO, FullStateCheckpointIO
from lightning_dist.checkpoint import model_state
from lightning_dist.checkpoint.layout import read_metadata
from lightning_dist.checkpoint.save_failures import describe_cause
from lightning_dist.checkpoint.validation import validate_checkpoint

PLUGINS = [DistributedCheckpointIO, AsyncDistributedCheckpointIO, FullStateCheckpointIO]


def _checkpoint(step: int, width: int = 4) -> dict:
    torch.manual_seed(step)
    return {"state_dict": model_state.model_state(nn.Linear(width, width), full=False), "global_step": step}


def _save(io_cls: type, path: Path, step: int, width: int = 4) -> None:
    io = io_cls()
    try:
        io.save_checkpoint(_checkpoint(step, width), path)
    finally:
        io.teardown()  # the async plugin raises its failure here, as at the end of training


def _free(folder: Path) -> int:
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory: pytest.TempPathFactory):
    """A 96 KiB file system: room for a small checkpoint, not for a 200 × 200 layer (160 KiB)."""
    folder = tmp_path_factory.mktemp("small_disk")
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (test_an_injected_full_disk_is_named_and_cleaned_up runs without)")
    mount = ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(folder)]
    mounted = subprocess.run(mount, capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


@pytest.mark.parametrize("io_cls", PLUGINS)
def test_a_full_disk_fails_the_save_cleanly(small_disk, io_cls):
    for entry in small_disk.iterdir():
        subprocess.run(["rm", "-rf", str(entry)], check=True)
    path = small_disk / "last.ckpt"
    _save(io_cls, path, step=1)
    free = _free(small_disk)
    with pytest.raises(CheckpointError) as failed:
        _save(io_cls, path, step=2, width=200)
    first_line = str(failed.value).splitlines()[0]
    assert first_line.startswith(f"Saving the checkpoint {str(path)!r} failed: no space left on device (")
    assert first_line.endswith(f"free on the file system of {str(small_disk)!r}).")
    assert sorted(p.name for p in small_disk.iterdir()) == ["last.ckpt"]  # no partial file left
    assert _free(small_disk) == free  # the space the partial files took is given back
    assert read_metadata(validate_checkpoint(path))["global_step"] == 1


class _FillingStream:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written, as on a full disk."""

    def __init__(self, raw, room: int) -> None:
        self.raw, self.room = raw, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.raw.write(data)

    def __getattr__(self, name):
        return getattr(self.raw, name)


@pytest.fixture
def disk_fills_at_shards(monkeypatch):
    """DCP's file system writes shards into a file that fills up after 100 bytes (torch's own stream, below the
    checksumming one)."""
    original = FileSystem.create_stream

    def create_stream(self, path, mode):
        from contextlib import contextmanager

        @contextmanager
        def stream():
            with original(self, path, mode) as raw:
                yield _FillingStream(raw, 100) if Path(path).name.endswith(".distcp") else raw

        return stream()

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


@pytest.mark.parametrize("io_cls", [DistributedCheckpointIO, AsyncDistributedCheckpointIO])
def test_an_injected_full_disk_is_named_and_cleaned_up(tmp_path, disk_fills_at_shards, io_cls):
    path = tmp_path / "step=4.ckpt"
    with pytest.raises(CheckpointError) as failed:
        _save(io_cls, path, step=4)
    lines = str(failed.value).splitlines()
    assert lines[0].startswith(f"Saving the checkpoint {str(path)!r} failed: no space left on device (")
    assert lines[1] == "Its partial files were removed; any previous checkpoint at that path is untouched."
    assert lines[2].startswith("Free space there (or keep fewer checkpoints: ModelCheckpoint(save_top_k=...))")
    assert lines[3].startswith("Details: rank 0: OSError: [Errno 28] No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_on_another_rank_is_named_on_rank_zero(tmp_path, disk_fills_at_shards):
    """DCP sends each rank's failure to rank 0 pickled, which drops its chain of causes: the OSError itself must
    arrive (torch's zip writer would have turned it into "unexpected pos 704 vs 598")."""
    import torch.distributed.checkpoint as dcp

    from lightning_dist.checkpoint.integrity import checksumming_writer

    with pytest.raises(CheckpointException) as failed:
        dcp.save({"w": torch.ones(100)}, storage_writer=checksumming_writer(tmp_path / "f"))
    as_received = pickle.loads(pickle.dumps(failed.value))
    assert describe_cause(as_received) == (
        "no space left on device",
        "Free space there (or keep fewer checkpoints: ModelCheckpoint(save_top_k=...)), or save elsewhere.",
    )


@pytest.mark.parametrize("io_cls", PLUGINS)
def test_a_failing_publish_keeps_the_previous_checkpoint(tmp_path, monkeypatch, io_cls):
    """The rename that publishes fails (EIO); for a folder, after the previous one was moved aside: it is put back."""
    path = tmp_path / "last.ckpt"
    _save(io_cls, path, step=1)
    replace, calls = os.replace, []

    def failing_replace(src, dst, **kwargs):
        calls.append(Path(src).name)
        if Path(src).name.startswith(".last.ckpt.tmp-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        return replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(CheckpointError) as failed:
        _save(io_cls, path, step=2)
    monkeypatch.undo()
    lines = str(failed.value).splitlines()
    assert lines[0].startswith(f"Saving the checkpoint {str(path)!r} failed: input/output error (")
    assert lines[2] == "The storage reported an error: check it before saving there again."
    if io_cls is FullStateCheckpointIO:
        assert [name.split("-")[0] for name in calls] == [".last.ckpt.tmp"]  # one atomic replace of a file
    else:  # the previous folder moved aside, the new one refused, the previous one moved back
        assert [name.split("-")[0] for name in calls] == ["last.ckpt", ".last.ckpt.tmp", ".last.ckpt.old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert read_metadata(validate_checkpoint(path))["global_step"] == 1
