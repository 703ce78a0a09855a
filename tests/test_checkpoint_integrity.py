"""Damaged checkpoints fail with a ``CheckpointError`` naming the file and what is wrong with it, on every path that
reads one: resume (``validate_checkpoint`` before launch, then ``load_checkpoint_into``), ``lightning-dist inspect``
and ``lightning-dist consolidate``. Checkpoints are written with the project's own IO plugins in one process (DCP
with two writer threads, so a sharded checkpoint has two shard files) and then damaged."""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_dist import AsyncDistributedCheckpointIO, CheckpointError, DistributedCheckpointIO, FullStateCheckpointIO
from lightning_dist.checkpoint import model_state
from lightning_dist.checkpoint.integrity import checksumming_writer
from lightning_dist.checkpoint.layout import COMPLETE_MARKER
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.commands import run_tool

SHARD = "__0_1.distcp"  # the second of the two shard files (the second writer thread's)


class _TwoShardIO(DistributedCheckpointIO):
    def _storage_writer(self, folder: Path):
        return checksumming_writer(folder, thread_count=2)


def _model(hidden: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters())


def _state(model: nn.Module, full: bool) -> dict:
    optimizer = _optimizer(model)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return {
        "state_dict": model_state.model_state(model, full=full),
        "optimizer_states": [model_state.optimizer_state(model, optimizer, full=full)],
        "global_step": 3,
    }


def _sharded(tmp_path: Path, hidden: int = 8) -> Path:
    path = tmp_path / "sharded.ckpt"
    _TwoShardIO().save_checkpoint(_state(_model(hidden), full=False), path)
    return path


def _single(tmp_path: Path) -> Path:
    path = tmp_path / "single.ckpt"
    FullStateCheckpointIO().save_checkpoint(_state(_model(), full=True), path)
    return path


def _old_marker(path: Path) -> Path:
    """What a save of an earlier lightning_dist version wrote: a marker without checksums."""
    (path / COMPLETE_MARKER).write_text("ok\n")
    return path


def _truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


def _overwrite(file: Path, at: float = 0.5, count: int = 64) -> None:
    data = bytearray(file.read_bytes())
    start = int(len(data) * at)
    data[start : start + count] = bytes(255 - b for b in data[start : start + count])
    file.write_bytes(bytes(data))


def _dict_without_state_dict(tmp_path: Path) -> Path:
    torch.save({"weights": torch.ones(2)}, tmp_path / "weights.ckpt")
    return tmp_path / "weights.ckpt"


def _bare_tensor(tmp_path: Path) -> Path:
    torch.save(torch.ones(3, 3), tmp_path / "tensor.ckpt")
    return tmp_path / "tensor.ckpt"


def _text_file(tmp_path: Path) -> Path:
    (tmp_path / "notes.ckpt").write_text("hello, these are my notes\n")
    return tmp_path / "notes.ckpt"


def _truncated_single(tmp_path: Path) -> Path:
    path = _single(tmp_path)
    _truncate(path)
    return path


def _overwritten_single(tmp_path: Path) -> Path:
    path = _single(tmp_path)
    with zipfile.ZipFile(path) as archive:
        tensors = [info for info in archive.infolist() if "/data/" in info.filename]
        record = max(tensors, key=lambda info: info.file_size)
    with path.open("r+b") as f:
        f.seek(record.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(record.header_offset + 30 + name_length + extra_length + record.file_size // 2)
        f.write(b"\xff" * 8)
    return path


def _garbage_meta(tmp_path: Path) -> Path:
    path = _sharded(tmp_path)
    (path / "meta.pt").write_bytes(b"garbage" * 10)
    return path


def _garbage_meta_old(tmp_path: Path) -> Path:
    path = _old_marker(_sharded(tmp_path))
    (path / "meta.pt").write_bytes(b"garbage" * 10)
    return path


def _truncated_shard(tmp_path: Path) -> Path:
    path = _sharded(tmp_path)
    _truncate(path / SHARD)
    return path


def _truncated_shard_old(tmp_path: Path) -> Path:
    path = _old_marker(_sharded(tmp_path))
    _truncate(path / SHARD)
    return path


def _deleted_shard(tmp_path: Path) -> Path:
    path = _sharded(tmp_path)
    (path / SHARD).unlink()
    return path


def _deleted_shard_old(tmp_path: Path) -> Path:
    path = _old_marker(_sharded(tmp_path))
    (path / SHARD).unlink()
    return path


def _overwritten_shard(tmp_path: Path) -> Path:
    path = _sharded(tmp_path)
    _overwrite(path / SHARD)
    return path


def _garbage_index(tmp_path: Path) -> Path:
    path = _old_marker(_sharded(tmp_path))
    (path / ".metadata").write_bytes(b"not a pickle")
    return path


def _damaged_marker(tmp_path: Path) -> Path:
    path = _sharded(tmp_path)
    (path / COMPLETE_MARKER).write_text('{"files": {"meta.pt": {"bytes": 3')
    return path


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path], Path]
    file: str  # the file the message names (a name inside the checkpoint, or the checkpoint file)
    problem: str  # regex of what is wrong
    before_launch: bool  # whether validate_checkpoint (run before processes are launched) already refuses it


CASES = [
    Case("dict without state_dict", _dict_without_state_dict, "weights.ckpt", r"holds a dict with the keys \['weights'\], but no 'state_dict'", False),
    Case("bare tensor", _bare_tensor, "tensor.ckpt", r"holds a Tensor, but no 'state_dict'", False),
    Case("text file", _text_file, "notes.ckpt", r"it is not a torch.save file \(it starts with b'hello", True),
    Case("truncated single file", _truncated_single, "single.ckpt", r"is cut short or damaged: its zip directory", True),
    Case("overwritten single file", _overwritten_single, "single.ckpt", r"does not match its checksum: record 'data/\d+'", False),
    Case("garbage meta.pt", _garbage_meta, "meta.pt", r"has 70 bytes but the save wrote [\d,]+", True),
    Case("garbage meta.pt, no checksums", _garbage_meta_old, "meta.pt", r"cannot be read \(UnpicklingError", False),
    Case("truncated shard", _truncated_shard, SHARD, r"has [\d,]+ bytes but the save wrote [\d,]+ \(cut short or replaced since\)", True),
    Case("truncated shard, no checksums", _truncated_shard_old, SHARD, r"the DCP index places data up to byte [\d,]+ \(truncated\)", True),
    Case("deleted shard", _deleted_shard, SHARD, r"is missing \(the save wrote [\d,]+ bytes there\)", True),
    Case("deleted shard, no checksums", _deleted_shard_old, SHARD, r"is missing \(the DCP index places", True),
    Case("overwritten shard", _overwritten_shard, SHARD, r"does not match its checksum \(CRC-32 [0-9a-f]{8}, the save recorded", False),
    Case("garbage DCP index", _garbage_index, ".metadata", r"\(the DCP index\) cannot be read", True),
    Case("damaged marker", _damaged_marker, COMPLETE_MARKER, r"\(the completion marker\) cannot be read", True),
]  # fmt: skip


def _message_regex(case: Case) -> str:
    return rf"{case.file}'.*{case.problem}"


@pytest.fixture(params=CASES, ids=lambda case: case.name)
def damaged(request, tmp_path) -> tuple[Case, Path]:
    return request.param, request.param.build(tmp_path)


def test_resume_refuses_a_damaged_checkpoint(damaged):
    case, path = damaged
    if case.before_launch:
        with pytest.raises(CheckpointError, match=_message_regex(case)):
            validate_checkpoint(path)
    else:
        validate_checkpoint(path)  # passes the cheap checks: found when the bytes are read
    model = _model()
    with pytest.raises(CheckpointError, match=_message_regex(case)):
        model_state.load_checkpoint_into(path, model, [_optimizer(model)], strict=True)


def test_inspect_reports_a_damaged_checkpoint_and_exits_non_zero(damaged, capsys):
    case, path = damaged
    with pytest.raises(SystemExit) as exit_:
        run_tool("inspect", [str(path)])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert "tensors," not in out  # no normal summary
    assert err.startswith("lightning-dist inspect: error: ")
    assert _matches(_message_regex(case), err)


def test_consolidate_refuses_a_damaged_checkpoint_and_writes_nothing(damaged, capsys, tmp_path):
    case, path = damaged
    out = tmp_path / "consolidated" / "out.ckpt"
    with pytest.raises(SystemExit) as exit_:
        run_tool("consolidate", [str(path), str(out)])
    assert exit_.value.code == 2
    assert _matches(_message_regex(case), capsys.readouterr().err)
    assert not out.parent.exists()


def _matches(regex: str, text: str) -> bool:
    return re.search(regex, text, flags=re.DOTALL) is not None


def test_a_checkpoint_of_another_model_still_names_the_key_and_both_shapes(tmp_path):
    path = _sharded(tmp_path, hidden=16)
    model = _model()
    with pytest.raises(CheckpointError, match=r"0\.weight: model \(8, 4\) vs checkpoint \(16, 4\)"):
        model_state.load_checkpoint_into(path, model, [_optimizer(model)], strict=True)


@pytest.mark.parametrize("build", [_sharded, _single], ids=["sharded", "single file"])
def test_intact_checkpoints_verify_and_inspect_says_so(tmp_path, capsys, build):
    path = build(tmp_path)
    model = _model()
    model_state.load_checkpoint_into(path, model, [_optimizer(model)], strict=True)
    run_tool("inspect", [str(path)])
    out = capsys.readouterr().out
    if path.is_dir():
        marker = json.loads((path / COMPLETE_MARKER).read_text())
        assert sorted(marker["files"]) == [".metadata", "__0_0.distcp", "__0_1.distcp", "meta.pt"]
        assert "integrity: 4 files, 4 checksums verified" in out
    else:
        assert "integrity: 1 file, " in out and " checksums verified" in out


def test_checkpoints_without_checksums_still_load(tmp_path, capsys):
    path = _old_marker(_sharded(tmp_path))
    model = _model()
    model_state.load_checkpoint_into(path, model, [_optimizer(model)], strict=True)
    run_tool("inspect", [str(path)])
    assert "no checksums recorded" in capsys.readouterr().out


def test_the_async_plugin_records_checksums_too(tmp_path):
    io = AsyncDistributedCheckpointIO()
    try:
        io.save_checkpoint(_state(_model(), full=False), tmp_path / "async.ckpt")
        io.wait()
    finally:
        io.teardown()
    marker = json.loads((tmp_path / "async.ckpt" / COMPLETE_MARKER).read_text())
    assert {".metadata", "__0_0.distcp", "meta.pt"} <= set(marker["files"])
    _overwrite(tmp_path / "async.ckpt" / "__0_0.distcp")
    model = _model()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp' does not match its checksum"):
        model_state.load_checkpoint_into(tmp_path / "async.ckpt", model, [_optimizer(model)], strict=True)
