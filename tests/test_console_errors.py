"""The console script on bad input: one line `lightning-dist <tool>: error: ...` and exit status 2, never a traceback;
a closed pipe ends it quietly; a YAML with only `model:` and `trainer:` trains from the module's own loaders."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from launch import REPO_ROOT

from lightning_dist import cli

BAD_PLANS = {
    "a module that is not there": (["--model", "nosuch.Model"], "cannot import 'nosuch'"),
    "a class that is not there": (["--model", "examples.gpt.Nope"], "module 'examples.gpt' has no 'Nope'"),
    "a missing config": (["--config", "/nonexistent/run.yaml"], "--config /nonexistent/run.yaml: no such file"),
    "malformed JSON": (["--model", "examples.gpt.GPT", "--init-args", "{bad"], "--init-args is not valid JSON"),
    "JSON that is not an object": (["--model", "examples.gpt.GPT", "--init-args", "[1]"], "must be a JSON object"),
    "an argument of the wrong type": (
        ["--model", "examples.gpt.GPT", "--init-args", '{"n_layer": "x"}'],
        'examples.gpt.GPT cannot be built from {"n_layer": "x"}',
    ),
    "the mesh planner's model": (
        ["--devices", "4", "--model", "nosuch.M", "--seq-len", "8", "--global-batch", "8"],
        "cannot import 'nosuch'",
    ),
    "the pipeline planner's split": (
        ["--strategy", "pipeline", "--pipeline-parallel-size", "2", "--model", "examples.gpt.GPT", "--split", "[x"],
        "--split is not valid JSON",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_plan_turns_bad_input_into_one_line_and_status_2(case, capsys, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    argv, message = BAD_PLANS[case]
    with pytest.raises(SystemExit) as ended:
        cli.main(["plan", *argv])
    err = capsys.readouterr().err.strip()
    assert ended.value.code == 2
    assert err.startswith("lightning-dist plan: error: ") and message in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_bad_yaml_config_is_one_line(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: [unclosed\n")
    with pytest.raises(SystemExit) as ended:
        cli.main(["plan", "--config", str(config)])
    assert ended.value.code == 2
    assert f"--config {config}: cannot be read as YAML" in capsys.readouterr().err


def test_fit_with_a_missing_ckpt_path_is_one_line_before_any_process_starts(capsys, monkeypatch):
    """The strategy's check before launch names the missing checkpoint; the console script prints it alone."""
    monkeypatch.chdir(REPO_ROOT)
    argv = ["fit", "--config", "configs/fsdp2.yaml", "--trainer.accelerator=cpu", "--ckpt_path", "/nonexistent.ckpt"]
    monkeypatch.setattr(sys, "argv", ["lightning-dist", *argv])
    with pytest.raises(SystemExit) as ended:
        cli.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert ended.value.code == 2
    assert err[-1] == "lightning-dist fit: error: Checkpoint not found: '/nonexistent.ckpt' does not exist.", err
    assert not any("Traceback" in line for line in err)


def test_inspect_into_a_pipe_that_closes_early_ends_quietly(tmp_path):
    """`lightning-dist inspect CKPT --all | head -1` on a checkpoint whose listing is larger than a pipe's buffer."""
    path = tmp_path / "many.ckpt"
    torch.save({"state_dict": {f"layers.{i}.weight": torch.zeros(2) for i in range(3000)}, "global_step": 0}, path)
    command = [sys.executable, "-m", "lightning_dist.cli", "inspect", str(path), "--all"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert first.startswith(b"checkpoint:") and err == ""


def test_a_yaml_with_only_model_and_trainer_trains_from_the_modules_own_loaders(tmp_path, monkeypatch):
    """No `data:` (a plain LightningCLI accepts that too) and the default `strategy: auto`."""
    config = tmp_path / "run.yaml"
    config.write_text(
        textwrap.dedent(
            f"""\
            model:
              class_path: user_modules.OwnSamplerGPT
              init_args: {{n_layer: 1, d_model: 16, n_head: 2, seq_len: 16, train_samples: 32}}
            trainer:
              accelerator: cpu
              devices: 1
              max_steps: 2
              logger: false
              enable_checkpointing: false
              enable_progress_bar: false
              use_distributed_sampler: false
              default_root_dir: {tmp_path}
            """
        )
    )
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests" / "scenarios"))
    monkeypatch.setattr(sys, "argv", ["lightning-dist", "fit", "--config", str(config)])
    cli.main()  # LightningCLI reads sys.argv (as the console script does)


def test_consolidate_to_a_path_it_cannot_write_is_one_line_and_leaves_nothing(tmp_path, capsys):
    source = tmp_path / "one.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 0}, source)
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(SystemExit) as ended:
        cli.main(["consolidate", str(source), str(tmp_path / "a_file" / "out.pt")])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[0].startswith(f"lightning-dist consolidate: error: Saving the checkpoint '{tmp_path}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "one.ckpt"]
