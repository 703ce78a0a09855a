"""`lightning-dist verify` run for real: the command in a subprocess, on real processes, with real checkpoints.

It must pass where the strategy is right (the example GPT under fsdp2 in fp32; tensor and context parallel in fp64
from the Python API; float8), and fail
with exit status 1 naming the cause where it is not: a module whose loss depends on the rank, a strategy that skips
one parameter's gradient reduction, and a sequence-pooling model under context parallelism. The user's classes live
in a file of the current directory, as `model.class_path` allows. Every model × strategy, 4-process meshes included,
is `python -m benchmarks.verify_matrix` (docs/verify.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from launch import FULL_MATRIX, REPO_ROOT

USER_CODE = textwrap.dedent(
    '''
    import torch
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.nn.parallel import DistributedDataParallel

    from examples.gpt import GPT


    class RankScaledGPT(GPT):
        """A user bug: the loss depends on the rank."""

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * (1 + self.global_rank)


    class DDPSkippingOneReduction(DDPStrategy):
        """Test-only: DDP that leaves one parameter out of its gradient all-reduce."""

        def _setup_model(self, model):
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ["blocks.0.ln1.weight"])
            return super()._setup_model(model)


    class PooledClassifier(L.LightningModule):
        """Token ids -> embedding -> mean over the sequence -> 3 classes."""

        def __init__(self, vocab_size: int = 64):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab_size, 16)
            self.head = torch.nn.Linear(16, 3)

        def training_step(self, batch, batch_idx):
            x = batch["input_ids"]
            return torch.nn.functional.cross_entropy(self.head(self.embed(x).mean(dim=1)), x[:, 0] % 3)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)
    '''
)

SMALL_GPT = ["--config", str(REPO_ROOT / "configs" / "fsdp2.yaml"), "--model.init_args.n_layer=2"]


def verify(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    """Run ``lightning-dist verify`` in ``tmp_path`` (the user's project: their classes in ``user_code.py``)."""
    (tmp_path / "user_code.py").write_text(USER_CODE)
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "lightning_dist.cli", "verify", *args, "--json", str(report)]
    done = subprocess.run(command, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert report.exists(), output[-3000:]
    return done.returncode, json.loads(report.read_text()), output


@pytest.mark.slow
def test_the_example_gpt_under_fsdp2_is_equivalent_and_every_quantity_is_compared(tmp_path):
    code, report, output = verify(tmp_path, *SMALL_GPT)
    assert code == 0 and report["passed"], output[-3000:]
    rows = report["rows"]
    quantities = {row["quantity"] for row in rows}
    assert {"loss", "logged train_loss", "gradient norm", "gradients", "learning rate"} <= quantities
    assert {"logged val_loss", "logged val_acc", "parameters", "optimizer state", "checkpoint"} <= quantities
    assert [row["when"] for row in rows if row["quantity"] == "loss"] == [
        "train batch 0",
        "train batch 1",
        "train batch 2",
    ]
    assert max(row["difference"] for row in rows) <= 1e-4 == report["tolerance"]
    assert "fsdp2 (dp_shard=2)" in report["strategy"] and "EQUIVALENT" in output
    assert not list(tmp_path.glob("lightning_logs")) and not list(tmp_path.glob("*.ckpt"))  # nothing of the user's


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): a rank-scaled loss also fails in test_verify_user_modules.py",
)
def test_a_loss_that_depends_on_the_rank_fails_and_the_line_is_named(tmp_path):
    code, report, output = verify(tmp_path, *SMALL_GPT, "--model.class_path=user_code.RankScaledGPT")
    assert code == 1 and not report["passed"], output[-3000:]
    assert report["first_difference"]["quantity"] == "loss"
    assert report["first_difference"]["when"] == "train batch 0"
    assert any("reads the rank" in c and "user_code.py" in c and "self.global_rank" in c for c in report["causes"])


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): ~22 s; verify's failing cases run with a rank-scaled loss in test_verify_user_modules.py",
)
def test_a_strategy_that_skips_one_gradient_reduction_is_named_with_the_parameter(tmp_path):
    strategy = {"class_path": "user_code.DDPSkippingOneReduction"}
    code, report, output = verify(tmp_path, *SMALL_GPT, f"--trainer.strategy={json.dumps(strategy)}")
    assert code == 1, output[-3000:]
    first = report["first_difference"]
    assert first["quantity"] == "gradient replicas" and first["when"] == "step 0"
    assert first["worst"][0][0] == "blocks.0.ln1.weight"
    assert any("'blocks.0.ln1.weight'" in c and "not reduced" in c for c in report["causes"])


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): context parallel refuses pooled outputs in test_context_parallel_strategy.py",
)
def test_a_model_that_pools_the_sequence_in_its_step_fails_under_context_parallel_naming_the_call(tmp_path):
    """The strategy refuses a model call that returns pooled outputs; this module pools in training_step between two
    calls, which the strategy cannot see. verify finds the difference and the place."""
    code, report, output = verify(
        tmp_path, *SMALL_GPT, "--trainer.strategy=context_parallel", "--model=user_code.PooledClassifier"
    )
    assert code == 1 and not report["failure"], output[-3000:]
    assert report["first_difference"]["quantity"] == "loss" and report["first_difference"]["when"] == "train batch 0"
    cause = report["causes"][0]
    assert "head (Linear) received (8, 16) under the strategy, the same as in one process" in cause, cause
    assert "after embed had received the split sequence ((8, 32) here, (8, 64) in one process)" in cause, cause
    # the checkpoint of a plain-SGD run (no optimizer state) loads in one process
    assert next(row for row in report["rows"] if row["quantity"] == "checkpoint")["ok"]


API_SCRIPT = textwrap.dedent(
    '''
    import json, sys
    import lightning_dist
    from examples.data import TextDataModule
    from examples.gpt import GPT


    class MyGPT(GPT):
        """Defined in the script: the runs must import it from here."""


    if __name__ == "__main__":
        model = MyGPT(vocab_size=64, seq_len=64, d_model=32, n_layer=2, n_head=4)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        common = dict(devices=2, steps=2, dtype="float64", accelerator="cpu", accumulate_grad_batches=2,
                      reference_cache="cache", anchor=False)
        report = lightning_dist.verify(model, TextDataModule(batch_size=4), strategy="tensor_parallel", **common)
        unchanged = all((before[k] == v).all() for k, v in model.state_dict().items())
        print(report.table())
        again = lightning_dist.verify(model, TextDataModule(batch_size=4), strategy="context_parallel", **common)
        print(again.table())
        json.dump({"report": report.to_json(), "unchanged": bool(unchanged), "again": again.to_json()},
                  open(sys.argv[1], "w"))
    '''
)


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): the Python API runs in test_verify_user_modules.py",
)
def test_the_python_api_verifies_a_module_defined_in_the_running_script(tmp_path):
    """``lightning_dist.verify(model, datamodule, ...)`` from a script, with gradient accumulation and a class the
    script itself defines; the caller's model is left as it was; unanchored (``anchor=False``), a second check
    reuses the cached reference."""
    (tmp_path / "run.py").write_text(API_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "run.py", str(out)], check=False, cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0 and out.exists(), (done.stdout + done.stderr)[-3000:]
    result = json.loads(out.read_text())
    report = result["report"]
    assert report["passed"] and report["tolerance"] == 1e-10 and result["unchanged"], report["summary"]
    # 2 optimizer steps of 2 accumulated batches each: 4 losses, 2 gradient comparisons
    assert sum(row["quantity"] == "loss" for row in report["rows"]) == 4
    assert [row["when"] for row in report["rows"] if row["quantity"] == "gradients"] == ["step 0", "step 1"]
    # a second strategy with the same global batch reuses the reference run kept in the cache (which only a
    # reference that trains on its own, anchor=False, can be: an anchored one follows the strategy's run)
    again = result["again"]
    assert again["passed"] and "cp=2" in again["strategy"], again["summary"]
    assert any("reference run was reused" in note for note in again["notes"]) and "reused" not in str(report["notes"])


@pytest.mark.slow
@pytest.mark.skipif(
    not FULL_MATRIX,
    reason="the full matrix (LIGHTNING_DIST_FULL_MATRIX=1): FP8 trains against its tolerance in test_float8.py",
)
def test_float8_is_compared_with_a_reference_converted_alike(tmp_path):
    """float8 (emulated on the CPU): the reference converts the same layers, so verify checks the parallelism; with
    rowwise scales each rank's FP8 rounding equals one process's, and the fp32 tolerance holds."""
    code, report, output = verify(
        tmp_path, "--config", str(REPO_ROOT / "configs" / "fsdp2_fp8.yaml"), "--model.init_args.n_layer=2",
        "--trainer.strategy.init_args.float8=rowwise", "--steps=2",
    )  # fmt: skip
    assert code == 0 and report["tolerance"] == 1e-4, output[-3000:]
    assert max(row["difference"] for row in report["rows"]) <= 1e-4
