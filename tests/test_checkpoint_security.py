"""Loading a checkpoint never runs code from it (unless the user opts in with ``weights_only=False`` or
``--trust-code``).

Each crafted checkpoint (:mod:`scenarios.crafted_checkpoints`) looks like one of ours, checksums included, and
creates a marker file if anything unpickles it in full. Every use of the package ends with a clear error and no
marker: the tools here (in-process), resume under fsdp2, tensor_parallel and pipeline and ``validate`` with
``ckpt_path`` in real processes, and the probe a save runs on what stands at its destination.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest
import torch
from launch import run_scenarios
from scenarios.crafted_checkpoints import (
    CRAFTED,
    PROCESS_CASES,
    CustomState,
    Payload,
    sharded,
    sharded_with_index,
    sharded_with_meta,
    single_file,
)
from torch.distributed.checkpoint import FileSystemReader

from lightning_dist import CheckpointError, DistributedCheckpointIO, FullStateCheckpointIO
from lightning_dist.checkpoint import model_state
from lightning_dist.checkpoint.consolidate import load_full_checkpoint
from lightning_dist.checkpoint.layout import check_replaceable, read_metadata, validate_checkpoint
from lightning_dist.checkpoint.safe_load import RestrictedFileSystemReader, read_dcp_index, resolve_weights_only
from lightning_dist.commands import run_tool

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
    of a larger index are in benchmarks/checkpoint_security.py."""
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


# ------------------------------------------------------------------------------------------- real processes
@pytest.mark.slow
def test_resume_and_validate_under_every_strategy_refuse_crafted_checkpoints(tmp_path):
    """2 ranks: ``fit(ckpt_path=crafted)`` under fsdp2, tensor_parallel and pipeline, and ``validate(ckpt_path=)``,
    for the three crafted checkpoints; then a checkpoint with a custom object resumes with ``weights_only=False``."""
    for name in PROCESS_CASES:
        CRAFTED[name](
            tmp_path / f"{name.replace(' ', '_').replace('.', '_')}.ckpt", tmp_path / f"RAN_{name.replace(' ', '_')}"
        )
    result = run_scenarios("security_runs.py", 2, tmp_path, ["crafted", "trusted"])
    assert not list(tmp_path.glob("RAN_*")), "a payload ran"
    for case, outcome in result["crafted"].items():
        assert outcome["error"] == "CheckpointError", (case, outcome)
        assert "builtins.exec" in outcome["message"], (case, outcome)
        assert "weights_only=False" in outcome["message"], (case, outcome)
    assert len(result["crafted"]) == 4 * len(PROCESS_CASES)
    trusted = result["trusted"]
    assert trusted["refused_by_default"] and "CustomState" in trusted["refused_by_default"]
    assert trusted["restored_value"] == 7
    assert trusted["resumed_global_step"] == trusted["saved_global_step"] + 1
    json.dumps(result)
