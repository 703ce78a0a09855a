"""Checkpoints crafted to run code when unpickled, as an attacker would publish them: each looks like one of ours
(provenance entry, a ``COMPLETE`` manifest whose sizes and checksums match), and unpickling any of them with full
pickle creates a marker file. Shared by tests/test_checkpoint_security.py and scenarios/security_runs.py."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import zlib
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_dist import DistributedCheckpointIO, FullStateCheckpointIO
from lightning_dist.checkpoint import model_state
from lightning_dist.checkpoint.layout import COMPLETE_MARKER, DCP_INDEX, METADATA_FILENAME, PROVENANCE_KEY
from lightning_dist.checkpoint.safe_load import read_dcp_index


class Payload:
    """Unpickling this calls ``exec``, which creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


class CustomState:
    """A harmless object of the user's own type, as a module's ``on_save_checkpoint`` might store."""

    def __init__(self, value: int) -> None:
        self.value = value


def _state(full: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return {
        "state_dict": model_state.model_state(model, full=full),
        "optimizer_states": [model_state.optimizer_state(model, optimizer, full=full)],
        "global_step": 3,
        "epoch": 0,
        PROVENANCE_KEY: {"strategy": "FSDP2Strategy", "world_size": 1},
    }


def single_file(path: Path, extra: object) -> Path:
    """A one-file checkpoint of ours with ``extra`` stored as a callback state."""
    FullStateCheckpointIO().save_checkpoint({**_state(full=True), "callbacks": {"Evil": extra}}, path)
    return path


def sharded(path: Path) -> Path:
    DistributedCheckpointIO().save_checkpoint(_state(full=False), path)
    return path


def _rewrite(folder: Path, name: str, data: bytes) -> None:
    """Replace ``folder/name`` and update the manifest's record of it, so the checksums still match."""
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / COMPLETE_MARKER).read_text())
    manifest["files"][name] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (folder / COMPLETE_MARKER).write_text(json.dumps(manifest, indent=1) + "\n")


def sharded_with_meta(path: Path, extra: object) -> Path:
    """A sharded checkpoint whose ``meta.pt`` holds ``extra``."""
    sharded(path)
    meta = torch.load(path / METADATA_FILENAME, weights_only=True)
    buffer = io.BytesIO()
    torch.save({**meta, "callbacks": {"Evil": extra}}, buffer)
    _rewrite(path, METADATA_FILENAME, buffer.getvalue())
    return path


def sharded_with_index(path: Path, extra: object) -> Path:
    """A sharded checkpoint whose DCP ``.metadata`` index carries ``extra`` in its planner data."""
    sharded(path)
    metadata = read_dcp_index(path)
    metadata.planner_data = {**(metadata.planner_data or {}), "evil": extra}
    _rewrite(path, DCP_INDEX, pickle.dumps(metadata))
    return path


def sharded_with_shard_item(path: Path, extra: object) -> Path:
    """A sharded checkpoint one of whose non-tensor shard items (an optimizer hyperparameter, which DCP stores as a
    ``torch.save`` of the value) is ``extra``: appended to its shard file, the index pointing at it."""
    sharded(path)
    metadata = read_dcp_index(path)
    key = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in metadata.storage_data if i.fqn == key)
    info = metadata.storage_data[index]
    shard = (path / info.relative_path).read_bytes()
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    metadata.storage_data[index] = dataclasses.replace(info, offset=len(shard), length=len(buffer.getvalue()))
    _rewrite(path, info.relative_path, shard + buffer.getvalue())
    _rewrite(path, DCP_INDEX, pickle.dumps(metadata))
    return path


#: name -> how to build it at a path, carrying a payload that creates ``marker``
CRAFTED = {
    "single file": lambda path, marker: single_file(path, Payload(marker)),
    "meta.pt": lambda path, marker: sharded_with_meta(path, Payload(marker)),
    "DCP index": lambda path, marker: sharded_with_index(path, Payload(marker)),
    "shard item": lambda path, marker: sharded_with_shard_item(path, Payload(marker)),
}

#: The crafted checkpoints the multi-process test resumes from: those refused before any tensor is read, whatever the
#: model ("shard item" is read after the model's keys are checked, so it is tested in-process with a matching model).
PROCESS_CASES = ("single file", "meta.pt", "DCP index")


# ------------------------------------------------------------------------------------ files outside the checkpoint
#: Where the crafted checkpoints below point: a folder beside the checkpoint, holding what they would read.
OUTSIDE = "outside"


def _move_out(folder: Path, name: str, stolen: str) -> Path:
    """Move ``folder/name`` to the ``outside`` folder beside ``folder`` (as ``stolen``): an intact file of the right
    content that the checkpoint no longer holds."""
    outside = folder.parent / OUTSIDE
    outside.mkdir(exist_ok=True)
    target = outside / stolen
    (folder / name).rename(target)
    return target


def _drop_record(folder: Path, name: str) -> None:
    manifest = json.loads((folder / COMPLETE_MARKER).read_text())
    del manifest["files"][name]
    (folder / COMPLETE_MARKER).write_text(json.dumps(manifest, indent=1) + "\n")


def _index_pointing_at(path: Path, relative_path: str) -> Path:
    """A sharded checkpoint whose DCP index names ``relative_path`` for every item of its shard, the shard moved out to
    ``outside/stolen.distcp``; the manifest no longer lists the shard, so every checksum it holds still matches."""
    sharded(path)
    metadata = read_dcp_index(path)
    shard = next(iter({info.relative_path for info in metadata.storage_data.values()}))
    _move_out(path, shard, "stolen.distcp")
    metadata.storage_data = {
        index: dataclasses.replace(info, relative_path=relative_path) for index, info in metadata.storage_data.items()
    }
    _drop_record(path, shard)
    _rewrite(path, DCP_INDEX, pickle.dumps(metadata))
    return path


def index_with_parent_path(path: Path) -> Path:
    """The DCP index names ``../outside/stolen.distcp``."""
    return _index_pointing_at(path, f"../{OUTSIDE}/stolen.distcp")


def index_with_absolute_path(path: Path) -> Path:
    """The DCP index names the absolute path of ``outside/stolen.distcp``."""
    return _index_pointing_at(path, str(path.parent.resolve() / OUTSIDE / "stolen.distcp"))


def shard_linked_outside(path: Path) -> Path:
    """The shard is a symbolic link to ``outside/stolen.distcp`` (an absolute link), its index and manifest intact."""
    sharded(path)
    shard = next(p.name for p in path.iterdir() if p.name.endswith(".distcp"))
    target = _move_out(path, shard, "stolen.distcp")
    (path / shard).symlink_to(target.resolve())
    return path


def manifest_with_parent_path(path: Path) -> Path:
    """The ``COMPLETE`` manifest records a file ``../outside/secret.txt`` (a check of its size would tell whether a
    file exists there, and how large it is)."""
    sharded(path)
    outside = path.parent / OUTSIDE
    outside.mkdir(exist_ok=True)
    (outside / "secret.txt").write_text("not for the checkpoint's author to learn about\n")
    manifest = json.loads((path / COMPLETE_MARKER).read_text())
    manifest["files"][f"../{OUTSIDE}/secret.txt"] = {"bytes": 1, "crc32": "00000000"}
    (path / COMPLETE_MARKER).write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def meta_linked_outside(path: Path) -> Path:
    """``meta.pt`` is a relative symbolic link to ``../outside/meta.pt`` (the intact file, moved out)."""
    sharded(path)
    _move_out(path, METADATA_FILENAME, METADATA_FILENAME)
    (path / METADATA_FILENAME).symlink_to(Path("..") / OUTSIDE / METADATA_FILENAME)
    return path


#: name -> (how to build it at a path, the entry every refusal names). Each reads files of the ``outside`` folder
#: beside the checkpoint if followed.
ESCAPING = {
    "index with ..": (index_with_parent_path, f"../{OUTSIDE}/stolen.distcp"),
    "index with an absolute path": (index_with_absolute_path, "stolen.distcp"),
    "shard linked outside": (shard_linked_outside, "__0_0.distcp"),
    "manifest with ..": (manifest_with_parent_path, f"../{OUTSIDE}/secret.txt"),
    "meta.pt linked outside": (meta_linked_outside, METADATA_FILENAME),
}

#: The one of them the multi-process test resumes from (every rank refuses before reading a shard).
PROCESS_ESCAPING = ("index with ..",)


def crafted_file_name(case: str) -> str:
    """Where the multi-process test builds the crafted checkpoint ``case`` in its workdir."""
    return f"{case.replace(' ', '_').replace('.', '_')}.ckpt"
