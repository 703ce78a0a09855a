"""Mistakes that are known before launch fail before launch: in the calling process, with no rank started.

The mistakes themselves are in the bad-input table (``tests/bad_input_table.py``); this module checks the machinery.

Each test calls ``trainer.fit``/``validate`` with ``devices=2`` on the CPU. The launcher's process creation is
replaced by a guard that fails the test, so a check that did not run before launch cannot pass unnoticed (and cannot
re-run pytest in child processes). A second Trainer on an already parallelized model needs real processes: see
``test_a_second_trainer_reuses_or_refuses_the_model``.
"""

from __future__ import annotations

import pytest
from launch import run_scenarios
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

from examples.gpt import GPT
from lightning_dist import FSDP2Strategy
from lightning_dist.strategies.lifecycle.preflight import PreflightLauncher, PreflightSubprocessLauncher


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def refuse(self: _SubprocessScriptLauncher) -> None:
        raise AssertionError("processes were launched although the configuration is invalid")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", refuse)


def _trainer(strategy, **kwargs) -> Trainer:
    return Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, max_steps=1, **kwargs)


def _gpt(**kwargs) -> GPT:
    return GPT(**{"vocab_size": 64, "seq_len": 16, "d_model": 32, "n_layer": 2, "n_head": 4, **kwargs})


def test_the_strategies_launch_through_the_preflight_launchers(monkeypatch):
    assert isinstance(_trainer("fsdp2").strategy.launcher, PreflightSubprocessLauncher)
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under torchrun: the processes exist already
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert isinstance(_trainer("fsdp2").strategy.launcher, PreflightLauncher)


def test_models_built_in_configure_model_are_checked_after_launch_only():
    class Deferred(GPT):
        def configure_model(self) -> None:  # layers would only exist from here on
            pass

    strategy = FSDP2Strategy(wrap_modules=["DecoderLayer"])
    trainer = _trainer(strategy)
    strategy._lightning_module = Deferred(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4)
    strategy.preflight(trainer, {})  # no error: the model is not complete before configure_model ran


@pytest.mark.slow
def test_a_second_trainer_reuses_or_refuses_the_model(tmp_path):
    """fsdp2 then tensor_parallel, fsdp2 then fsdp2_grad_op: refused on every rank with the same message naming the
    differences; fsdp2 then fsdp2 (equal settings): the model is reused and trains."""
    result = run_scenarios("reuse_runs.py", 2, tmp_path, ["fsdp2_then_tp", "fsdp2_then_grad_op", "fsdp2_then_fsdp2"])
    to_tp = result["fsdp2_then_tp"]["errors"]
    assert to_tp[0] == to_tp[1] and to_tp[0] is not None
    assert "GPT was already parallelized by an earlier Trainer with FSDP2Strategy" in to_tp[0]
    assert "strategy: FSDP2Strategy → TensorParallelStrategy" in to_tp[0]
    assert "Give this Trainer a fresh, unsharded instance of the model" in to_tp[0]
    to_grad_op = result["fsdp2_then_grad_op"]["errors"]
    assert to_grad_op[0] == to_grad_op[1] and "sharding: 'full' → 'grad_op'" in to_grad_op[0]
    assert result["fsdp2_then_fsdp2"]["errors"] == [None, None]


PLAIN_FIT = """
import sys
import lightning as L
import torch
import lightning_dist

class Plain(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)
trainer = L.Trainer(accelerator="cpu", devices=1, strategy="fsdp2", max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Plain(), data)
print("LOADED", "transformers.modeling_utils" in sys.modules, "torchao" in sys.modules)
"""


def test_a_module_of_the_user_s_own_loads_no_transformers_model_code():
    """The checks before launch looked for transformers models with ``from transformers import PreTrainedModel``:
    for a module that has none, that loaded transformers' model code (0.7 s) and, through it, torchao, which printed
    its own warnings in every process. A fit of a plain module loads neither."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", PLAIN_FIT], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED False False" in proc.stdout, proc.stdout[-2000:]
    assert "torchao" not in proc.stderr, proc.stderr[-2000:]
