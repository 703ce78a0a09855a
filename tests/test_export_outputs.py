"""Outputs never replace each other (issue 54, item 6): ``consolidate`` and ``export`` refuse each other's outputs
and files inside an export folder, an export refuses an earlier export of another format, and an export killed with
SIGKILL at each point of its write and publish leaves, after a re-run, exactly one complete folder and nothing
hidden. The checkpoint: a stock Llama trained two steps under fsdp2 in one process (tests/test_export.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.export import export_checkpoint
from lightning_dist.checkpoint.export_target import is_own_export_folder
from lightning_dist.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]


def _refused(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """The message of a ``lightning-dist`` command that refuses to run (exit status 2, the reason on stderr)."""
    with pytest.raises(SystemExit) as exit:
        cli_main(argv)
    assert exit.value.code == 2
    return capsys.readouterr().err


def test_consolidate_and_export_refuse_each_others_outputs(llama_checkpoint, tmp_path, capsys):
    folder, file = tmp_path / "exp", tmp_path / "c.ckpt"
    export_checkpoint(llama_checkpoint, folder, format="hf")
    cli_main(["consolidate", str(llama_checkpoint), str(file)])
    before = {p: p.read_bytes() for p in [file, *folder.iterdir()]}
    message = _refused(capsys, ["consolidate", str(llama_checkpoint), str(folder)])
    assert "it is an export folder (--format hf) written by `lightning-dist export`; this writes one file" in message
    with pytest.raises(CheckpointError, match="it is a file written by `lightning-dist consolidate`; an export write"):
        export_checkpoint(llama_checkpoint, file, format="hf")
    for inside in ("model.safetensors", "new.safetensors"):
        assert "it is inside the export folder" in _refused(
            capsys, ["consolidate", str(llama_checkpoint), str(folder / inside)]
        )
    assert "it is a file written by `lightning-dist consolidate`" in _refused(
        capsys, ["export", str(llama_checkpoint), str(file), "--format", "hf"]
    )
    assert {p: p.read_bytes() for p in [file, *folder.iterdir()]} == before
    cli_main(["consolidate", str(llama_checkpoint), str(file)])  # each replaces its own earlier output
    export_checkpoint(llama_checkpoint, folder, format="hf")


def test_an_export_replaces_only_an_export_of_its_own_format(llama_checkpoint, tmp_path):
    export_checkpoint(llama_checkpoint, tmp_path / "hf", format="hf")
    with pytest.raises(CheckpointError, match=r"export of another format \(a Hugging Face model folder, --format hf"):
        export_checkpoint(llama_checkpoint, tmp_path / "hf", format="litgpt", config=None)
    assert is_own_export_folder(tmp_path / "hf") and (tmp_path / "hf" / "config.json").exists()


_KILLER = """
import os, signal, sys
import lightning_dist.checkpoint.export.folder as folder
import lightning_dist.checkpoint.layout as layout
import safetensors.torch as st
from lightning_dist.checkpoint.export import export_checkpoint

point = sys.argv[3]
def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)
if point == "writing":  # after the first file is in the temporary folder
    save = st.save_file
    st.save_file = lambda *a, **k: (save(*a, **k), die())
elif point == "marked":  # the temporary folder complete and marked, not yet published
    mark = folder.mark_export_folder
    folder.mark_export_folder = lambda *a, **k: (mark(*a, **k), die())
elif point == "between_renames":  # the previous export set aside, the new one not yet at OUT
    replace, calls = os.replace, []
    def second(*a):
        calls.append(a)
        if len(calls) == 2:
            die()
        return replace(*a)
    layout.os.replace = second
elif point == "before_discard":  # the new export at OUT, the previous one still set aside
    layout.discard = die
export_checkpoint(sys.argv[1], sys.argv[2], format="hf", max_shard_size="20KB")
"""


@pytest.mark.parametrize("point", ["writing", "marked", "between_renames", "before_discard"])
def test_a_killed_export_is_finished_or_cleaned_up_by_a_re_run(llama_checkpoint, tmp_path, point):
    out = tmp_path / "out"
    export_checkpoint(llama_checkpoint, out, format="hf")  # an earlier export, one file
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", _KILLER, str(llama_checkpoint), str(out), point]
    killed = subprocess.run(command, env=env, cwd=tmp_path, check=False, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    hidden = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert hidden, "the kill left nothing to finish"
    assert out.exists() == (point != "between_renames")
    report = export_checkpoint(llama_checkpoint, out, format="hf", max_shard_size="20KB")
    assert report.tidied and all(".out." in line for line in report.tidied), report.tidied
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert is_own_export_folder(out) and "model.safetensors.index.json" in report.files


def test_an_adapter_export_of_a_model_without_adapters_is_refused_before_anything_is_written(
    llama_checkpoint, tmp_path
):
    with pytest.raises(CheckpointError, match="--format peft writes a PEFT adapter, and the checkpoint holds no PEFT"):
        export_checkpoint(llama_checkpoint, tmp_path / "adapter", format="peft")
    assert list(tmp_path.iterdir()) == []
