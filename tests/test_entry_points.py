"""The three ways users start a run each train the example on 2 real processes: a registered name in Python,
`class_path` YAML in a plain LightningCLI, and the `lightning-dist` console script with a strategy name in YAML."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from launch import REPO_ROOT, run_training_command

pytestmark = pytest.mark.slow

SHORT_RUN = [
    "--trainer.max_steps=4",
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


@pytest.fixture(autouse=True)
def _root_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LD_TEST_ROOT", str(tmp_path))


def _run(cmd: list[str]) -> str:
    return run_training_command(cmd, os.environ["LD_TEST_ROOT"], max_steps=4)


def test_registered_name_from_python():
    out = _run(
        [sys.executable, "examples/train.py", "--strategy", "fsdp2", "--devices", "2", "--accelerator", "cpu"]
        + ["--max-steps", "4"]
    )
    assert (
        "fsdp2: sharding='full': sharded 4 × Block + [tok_emb, pos_emb, ln_f, head] as one unit + root GPT over" in out
    )


def test_class_path_yaml_in_a_plain_lightning_cli():
    out = _run(
        [sys.executable, "tests/scenarios/plain_cli.py", "fit", "--config", "configs/fsdp2_class_path.yaml", *SHORT_RUN]
    )
    assert "precision=bf16-mixed" in out and "sharded 4 × Block" in out


def test_lightning_dist_console_script_with_a_strategy_name():
    script = shutil.which("lightning-dist")
    assert script is not None, "the console script is installed by `pip install -e .`"
    out = _run([script, "fit", "--config", "configs/fsdp2.yaml", *SHORT_RUN])
    assert "fsdp2: mesh dp_shard=2 over 2 processes" in out
    assert "LightningCLI's args parameter" not in out  # the CLI reads sys.argv itself: no warning about both


def test_console_script_refuses_transformer_engine_before_building_the_trainer(capsys):
    from lightning_dist import cli

    with pytest.raises(
        SystemExit, match="precision='transformer-engine' is not supported.*installing transformer_engine"
    ):
        cli.main(["fit", "--config", str(REPO_ROOT / "configs/fsdp2.yaml"), "--trainer.precision=transformer-engine"])
