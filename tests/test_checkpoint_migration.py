"""Real Trainers on 2 processes: the user's folder survives a refused save on every rank, and a checkpoint of
Lightning's own ModelParallelStrategy is resumed under fsdp2, inspected and consolidated (migration)."""

from __future__ import annotations

import pytest
import torch
from launch import max_abs_diff, run_scenarios

from examples.gpt import GPT
from lightning_dist.checkpoint.consolidate import load_full_checkpoint
from lightning_dist.checkpoint.summary import summarize_checkpoint
from lightning_dist.commands import run_tool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("migration")
    scenarios = ["refuse_user_folder", "lightning_model_parallel", "resume_lightning_checkpoint_under_fsdp2"]
    return workdir, run_scenarios("migration_runs.py", 2, workdir, scenarios)


def test_save_checkpoint_onto_a_users_folder_is_refused_on_every_rank(runs):
    workdir, result = runs
    refused = result["refuse_user_folder"]
    for io in ("sharded", "full"):
        message = refused[io]
        assert message is not None and message.startswith(
            f"Refusing to write a checkpoint to {str(workdir / 'ckpts')!r}"
        )
        assert "it is a directory that is not a lightning_dist checkpoint (1 entry: notes.txt)" in message
        assert refused[f"{io}_all_ranks"] == [message, message]
    assert refused["left"] == ["notes.txt"] and refused["notes"] == "my notes, not a checkpoint\n"


def test_a_lightning_model_parallel_checkpoint_resumes_under_fsdp2(runs):
    _, result = runs
    reference = result["lightning_model_parallel"]["losses"]
    migrated = result["resume_lightning_checkpoint_under_fsdp2"]["losses"]
    assert len(reference) == 6 and len(migrated) == 3
    assert max_abs_diff(reference[3:], migrated) < 1e-10


def test_a_lightning_model_parallel_checkpoint_is_inspected_and_consolidated(runs, tmp_path, capsys):
    workdir, _ = runs
    source = workdir / "lightning_mp" / "step=3.ckpt"
    summary = summarize_checkpoint(source)
    assert summary.global_step == 3 and any(e.key.startswith("state_dict.blocks.0.") for e in summary.tensors)
    out = tmp_path / "model.ckpt"
    run_tool("consolidate", [str(source), str(out)])
    consolidated = torch.load(out, weights_only=False)
    assert consolidated["state_dict"].keys() == load_full_checkpoint(source)["state_dict"].keys()
    model = GPT.load_from_checkpoint(out)  # a plain one-process model from Lightning's sharded checkpoint
    head = consolidated["state_dict"]["head.weight"]
    assert head.dtype == torch.float64 and torch.equal(model.state_dict()["head.weight"], head.float())
