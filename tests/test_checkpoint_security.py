"""Loading a checkpoint never runs code from it (unless the user opts in with ``weights_only=False`` or
``--trust-code``), and never reads a file outside its folder.

Each crafted checkpoint (:mod:`scenarios.crafted_checkpoints`) looks like one of ours, checksums included, and
creates a marker file if anything unpickles it in full. Every use of the package ends with a clear error and no
marker: the tools here (in-process), resume under fsdp2, tensor_parallel and pipeline and ``validate`` with
``ckpt_path`` in real processes, and the probe a save runs on what stands at its destination.

Checkpoints whose index, manifest or links name files outside their folder (:data:`scenarios.crafted_checkpoints.
ESCAPING`) are refused by every reader, naming the entry, before any file outside is opened, with the same words
whether or not those files exist.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from launch import run_scenarios
from scenarios.crafted_checkpoints import (
    CRAFTED,
    ESCAPING,
    OUTSIDE,
    PROCESS_CASES,
    PROCESS_ESCAPING,
    CustomState,
    Payload,
    crafted_file_name,
    shard_linked_outside,
    sharded,
    sharded_with_index,
    sharded_with_meta,
    single_file,
)
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader

from lightning_dist import CheckpointError, DistributedCheckpointIO, FullStateCheckpointIO
from lightning_dist.checkpoint import model_state
from lightning_dist.checkpoint.consolidate import load_full_checkpoint
from lightning_dist.checkpoint.contained_paths import checkpoint_file
from lightning_dist.checkpoint.layout import check_replaceable, read_metadata
from lightning_dist.checkpoint.safe_load import (
    RestrictedFileSystemReader,
    dcp_reader,
    read_dcp_index,
    resolve_weights_only,
    shard_error,
)
from lightning_dist.checkpoint.summary import summarize_checkpoint
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.commands import run_tool
from lightning_dist.compat import load_dcp_without_process_group
from lightning_dist.verification.run import _checkpoint_row

REFUSAL = r"(weights_only=True|could run code).*(weights_only=False|--trust-code)"


@pytest.fixture(params=list(CRAFTED), ids=str)
def crafted(request, tmp_path) -> tuple[str, Path, Path]:
    """(name, checkpoint, marker): the marker appears if the checkpoint's payload runs."""
    marker = tmp_path / "PAYLOAD_RAN"
    return request.param, CRAFTED[request.param](tmp_path / "evil.ckpt", marker), marker


@pytest.mark.parametrize("tool", ["inspect", "consolidate"])
def test_the_tools_refuse_a_crafted_checkpoint_without_running_it(crafted, tool, capsys, tmp_path):
    name, path, marker = crafted
    out = tmp_path / "out" / "consolidated.ckpt"
    argv = [str(path)] if tool == "inspect" else [str(path), str(out)]
    if name == "shard item" and tool == "inspect":  # inspect reads the index only, never a shard item
        run_tool(tool, argv)
        assert not marker.exists()
        return
    with pytest.raises(SystemExit) as exit_:
        run_tool(tool, argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "builtins.exec" in err, err  # names the type it refused
    assert "--trust-code" in err
    assert not marker.exists()
    assert not out.parent.exists()


def test_loading_into_a_model_refuses_a_crafted_checkpoint_without_running_it(crafted):
    _, path, marker = crafted
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    with pytest.raises(CheckpointError, match=r"builtins\.exec"):
        model_state.load_checkpoint_into(path, model, [torch.optim.AdamW(model.parameters())], strict=True)
    assert not marker.exists()


@pytest.mark.parametrize("name", [name for name in CRAFTED if name != "single file"])  # a file: torch.load's own
def test_lightning_s_own_loaders_refuse_a_crafted_folder_without_running_it(name, tmp_path):
    """``LightningModule.load_from_checkpoint`` and Lightning's ``TorchCheckpointIO`` read a sharded folder through
    lightning_dist once it is imported (plugins/folder_loading.py), weights-only unless told otherwise."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from examples.gpt import GPT

    marker = tmp_path / "PAYLOAD_RAN"
    path = CRAFTED[name](tmp_path / "evil.ckpt", marker)
    assert path.is_dir()
    for load in (lambda: GPT.load_from_checkpoint(path), lambda: TorchCheckpointIO().load_checkpoint(path)):
        with pytest.raises(CheckpointError, match=r"builtins\.exec"):
            load()
    assert not marker.exists(), name


def test_the_dcp_index_is_refused_before_launch(tmp_path):
    """``validate_checkpoint`` runs before any process is launched; a crafted index fails there, naming the type."""
    marker = tmp_path / "PAYLOAD_RAN"
    path = sharded_with_index(tmp_path / "evil.ckpt", Payload(marker))
    with pytest.raises(CheckpointError, match=r"DCP index .*names 'builtins\.exec'.*--trust-code"):
        validate_checkpoint(path)
    assert not marker.exists()


def test_torch_s_own_reader_would_have_run_the_index_payload(tmp_path):
    """The control: torch's FileSystemReader unpickles ``.metadata`` in full (why we read it ourselves)."""
    marker = tmp_path / "PAYLOAD_RAN"
    path = sharded_with_index(tmp_path / "evil.ckpt", Payload(marker))
    FileSystemReader(path).read_metadata()
    assert marker.exists()


@pytest.mark.parametrize("io_cls", [DistributedCheckpointIO, FullStateCheckpointIO])
@pytest.mark.parametrize("ours", [True, False], ids=["with our provenance", "without"])
def test_a_crafted_file_at_the_save_destination_is_probed_without_running_it(tmp_path, io_cls, ours):
    """A save looks at what stands at its path (to replace only our own checkpoints): it reads the plain entries
    and never runs the file. One carrying our provenance is replaced; anything else is refused."""
    marker = tmp_path / "PAYLOAD_RAN"
    target = tmp_path / "last.ckpt"
    entries = {"state_dict": {}, "evil": Payload(marker)}
    if ours:
        entries["lightning_dist"] = {"strategy": "FSDP2Strategy"}
    torch.save(entries, target)
    if ours:
        check_replaceable(target)
        io_cls().save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, target)
        assert validate_checkpoint(target) == target
    else:
        with pytest.raises(CheckpointError, match="not a lightning_dist checkpoint"):
            io_cls().save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 1}, target)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------- opting in
@pytest.mark.parametrize("build", [single_file, sharded_with_meta], ids=["single file", "sharded meta.pt"])
def test_a_custom_object_names_its_type_and_loads_when_trusted(tmp_path, build):
    path = build(tmp_path / "custom.ckpt", CustomState(7))
    type_name = f"{CustomState.__module__}.CustomState"
    with pytest.raises(CheckpointError, match=rf"the type '{type_name}'.*weights_only=False"):
        read_metadata(path)
    assert read_metadata(path, weights_only=False)["callbacks"]["Evil"].value == 7
    assert load_full_checkpoint(path, weights_only=False)["callbacks"]["Evil"].value == 7
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    meta = model_state.load_checkpoint_into(path, model, [], strict=True, weights_only=False)
    assert meta["callbacks"]["Evil"].value == 7


def test_trust_code_makes_the_tools_load_a_custom_object(tmp_path, capsys):
    path = sharded_with_meta(tmp_path / "custom.ckpt", CustomState(7))
    with pytest.raises(SystemExit):
        run_tool("inspect", [str(path)])
    assert "CustomState" in capsys.readouterr().err
    run_tool("inspect", [str(path), "--trust-code"])
    assert "custom.ckpt" in capsys.readouterr().out
    out = tmp_path / "full.ckpt"
    run_tool("consolidate", [str(path), str(out), "--trust-code"])
    assert torch.load(out, weights_only=False)["callbacks"]["Evil"].value == 7


def test_weights_only_none_follows_torch_s_default(monkeypatch):
    assert resolve_weights_only(None) is True
    assert resolve_weights_only(False) is False
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    assert resolve_weights_only(None) is False
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    assert resolve_weights_only(False) is True


def test_a_normal_index_reads_the_same_as_torch_s_reader(tmp_path):
    path = sharded(tmp_path / "ok.ckpt")
    ours, theirs = RestrictedFileSystemReader(path).read_metadata(), FileSystemReader(path).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data


def test_reading_the_index_costs_no_more_than_torch_s_reader(tmp_path):
    """The restricted unpickler is a pure-Python find_class over C pickle: the same speed within noise. The figures
    of a larger index are in benchmarks/studies/checkpoint_security.py."""
    path = sharded(tmp_path / "ok.ckpt")
    assert (
        pickle.loads((path / ".metadata").read_bytes()).state_dict_metadata == read_dcp_index(path).state_dict_metadata
    )

    def best_of(fn, repeat: int = 30) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    ours = best_of(lambda: RestrictedFileSystemReader(path).read_metadata())
    theirs = best_of(lambda: FileSystemReader(path).read_metadata())
    assert ours < 3 * theirs + 1e-3, (ours, theirs)


# ------------------------------------------------------------------------------ files outside the checkpoint
_OPENED: list[str] | None = None  # while recording: the real path of every file this process opens


def _record_open(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_record_open)  # audit hooks cannot be removed: it records only inside `_opened_files`


@contextmanager
def _opened_files() -> Iterator[list[str]]:
    """Every file opened (through Python's ``open``/``os.open``, as DCP, zipfile and torch.load do) in the block."""
    global _OPENED
    _OPENED = opened = []
    try:
        yield opened
    finally:
        _OPENED = None


def _tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _what_every_reader_says(path: Path, out: Path, capsys) -> dict[str, str]:
    """What each reader of the package says about ``path``: its error, or "loaded"."""

    def outcome(read) -> str:
        try:
            read()
        except CheckpointError as err:
            return str(err)
        except SystemExit as exit_:
            return f"exit {exit_.code}: {capsys.readouterr().err}"
        return "loaded"

    model = _tiny_model()
    told = {
        "validate_checkpoint (before launch)": outcome(lambda: validate_checkpoint(path)),
        "resume (load_checkpoint_into)": outcome(
            lambda: model_state.load_checkpoint_into(path, model, [torch.optim.AdamW(model.parameters())], True)
        ),
        "load_full_checkpoint": outcome(lambda: load_full_checkpoint(path)),
        "load_full_checkpoint, trusted": outcome(lambda: load_full_checkpoint(path, weights_only=False)),
        "checkpoint IO load_checkpoint": outcome(lambda: DistributedCheckpointIO().load_checkpoint(path)),
        "summarize_checkpoint": outcome(lambda: summarize_checkpoint(path)),
        "inspect": outcome(lambda: run_tool("inspect", [str(path)])),
        "inspect --no-checksums": outcome(lambda: run_tool("inspect", [str(path), "--no-checksums"])),
        "consolidate": outcome(lambda: run_tool("consolidate", [str(path), str(out)])),
    }
    row = _checkpoint_row(_tiny_model(), path, [])
    told["verify's checkpoint row"] = row.detail if row.difference == float("inf") else "loaded"
    return told


@pytest.fixture(params=list(ESCAPING), ids=str)
def escaping(request, tmp_path) -> tuple[Path, str]:
    """(checkpoint, the entry its refusals name): a checkpoint that reads files of ``tmp_path/outside`` if followed."""
    build, entry = ESCAPING[request.param]
    return build(tmp_path / "evil.ckpt"), entry


def test_every_reader_refuses_a_checkpoint_naming_files_outside_its_folder(escaping, tmp_path, capsys):
    path, entry = escaping
    out = tmp_path / "exports" / "model.ckpt"
    outside = os.path.realpath(tmp_path / OUTSIDE)
    with _opened_files() as opened:
        told = _what_every_reader_says(path, out, capsys)
    assert [f for f in opened if f.startswith(outside + os.sep)] == []
    for reader, text in told.items():
        assert "outside the checkpoint folder" in text and entry in text, (reader, text)
    assert told["inspect"].startswith("exit 2") and told["consolidate"].startswith("exit 2")
    assert not out.parent.exists()
    # Nothing is told about what lies outside: the same words when it is gone.
    shutil.rmtree(tmp_path / OUTSIDE)
    assert _what_every_reader_says(path, out, capsys) == told


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("../x.distcp", "'..' leads out of it"),
        ("sub/../x.distcp", "'..' leads out of it"),  # even where it would come back in
        ("/etc/x.distcp", "an absolute path"),
        ("", "not a file name"),
        (".", "not a file name"),
        (3, "by a value of type int"),
        ("x\0.distcp", "a NUL character"),
    ],
)
def test_the_names_a_checkpoint_may_give_its_files(tmp_path, name, problem):
    with pytest.raises(CheckpointError, match=re.escape(problem)):
        checkpoint_file(tmp_path, name, "its DCP index")
    for fine in ("__0_0.distcp", "sub/__0_0.distcp", "./x.distcp", Path("x.distcp")):
        assert checkpoint_file(tmp_path, fine, "its DCP index") == tmp_path / fine


@pytest.mark.parametrize("name", ["index with ..", "index with an absolute path", "shard linked outside"])
@pytest.mark.parametrize("trusted", [False, True], ids=["restricted reader", "trusted reader"])
def test_the_dcp_reader_refuses_on_its_own(tmp_path, name, trusted):
    """Past every check (a checkpoint changed after it was validated), the DCP reader itself refuses before reading:
    a load into a model, and a load without a process group."""
    path = ESCAPING[name][0](tmp_path / "evil.ckpt")
    model = _tiny_model()
    with _opened_files() as opened:
        with pytest.raises(CheckpointError, match=r"is refused: .*its DCP index.*outside the checkpoint folder"):
            model_state.load_sharded(
                path, model, [torch.optim.AdamW(model.parameters())], True, weights_only=not trusted
            )
        with pytest.raises(CheckpointException) as err:
            load_dcp_without_process_group(dcp_reader(path, weights_only=not trusted))
        assert "outside the checkpoint folder" in str(shard_error(err.value, "load"))
    assert not [f for f in opened if f.startswith(os.path.realpath(tmp_path / OUTSIDE))]


def test_torch_s_own_reader_would_have_read_the_file_outside(tmp_path):
    """The control: DCP resolves the index's paths without looking where they lead."""
    path = ESCAPING["index with .."][0](tmp_path / "evil.ckpt")
    with _opened_files() as opened:
        load_dcp_without_process_group(FileSystemReader(path))
    assert os.path.realpath(tmp_path / OUTSIDE / "stolen.distcp") in opened


def test_links_that_stay_inside_the_checkpoint_are_followed(tmp_path):
    """A link to a checkpoint folder (Lightning's ``save_last="link"``) and a link inside the folder to one of its own
    files both load."""
    path = shard_linked_outside(tmp_path / "step=3.ckpt")  # then moved back inside, under another name
    shard = path / "__0_0.distcp"
    (tmp_path / OUTSIDE / "stolen.distcp").rename(path / "shard.bin")
    shard.unlink()
    shard.symlink_to("shard.bin")
    (tmp_path / "last.ckpt").symlink_to("step=3.ckpt")
    for checkpoint in (path, tmp_path / "last.ckpt"):
        assert load_full_checkpoint(checkpoint)["global_step"] == 3
        model = _tiny_model()
        model_state.load_checkpoint_into(checkpoint, model, [torch.optim.AdamW(model.parameters())], strict=True)


# ------------------------------------------------------------------------------------------- real processes
@pytest.mark.slow
def test_resume_and_validate_under_every_strategy_refuse_crafted_checkpoints(tmp_path):
    """2 ranks: ``fit(ckpt_path=crafted)`` under fsdp2, tensor_parallel and pipeline, and ``validate(ckpt_path=)``,
    for the three crafted checkpoints, and ``fit`` under fsdp2 from one whose index names a file outside its folder;
    then a checkpoint with a custom object resumes with ``weights_only=False``."""
    for name in PROCESS_CASES:
        CRAFTED[name](tmp_path / crafted_file_name(name), tmp_path / f"RAN_{name.replace(' ', '_')}")
    for name in PROCESS_ESCAPING:
        ESCAPING[name][0](tmp_path / crafted_file_name(name))
    result = run_scenarios("security_runs.py", 2, tmp_path, ["crafted", "trusted"])
    assert not list(tmp_path.glob("RAN_*")), "a payload ran"
    for case, outcome in result["crafted"].items():
        assert outcome["error"] == "CheckpointError", (case, outcome)
        if case.endswith(PROCESS_ESCAPING):
            assert "outside the checkpoint folder" in outcome["message"], (case, outcome)
            continue
        assert "builtins.exec" in outcome["message"], (case, outcome)
        assert "weights_only=False" in outcome["message"], (case, outcome)
    assert len(result["crafted"]) == 4 * len(PROCESS_CASES) + len(PROCESS_ESCAPING)
    trusted = result["trusted"]
    assert trusted["refused_by_default"] and "CustomState" in trusted["refused_by_default"]
    assert trusted["restored_value"] == 7
    assert trusted["resumed_global_step"] == trusted["saved_global_step"] + 1
    json.dumps(result)
