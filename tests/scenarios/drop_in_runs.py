"""Drop-in from Lightning's strategies (issue 55).

A module written for Lightning's ``ModelParallelStrategy``, as Lightning's tensor-parallel docs teach it: its
``configure_model`` applies ``parallelize_module`` on ``self.device_mesh["tensor_parallel"]`` and ``fully_shard``
on ``self.device_mesh["data_parallel"]``. The same module, unchanged, under Lightning's strategy and under
``TensorParallelStrategy`` given the same arguments (only the class name changed); each fit saves a checkpoint at
step 3 and trains to step 6, and each resumes the other's step-3 checkpoint. And the example GPT under
``FSDP2Strategy`` given Lightning ``FSDPStrategy``'s arguments as its docs write them (``fsdp_arguments``), against
one process (``one_process``), saving a checkpoint at the end.

python tests/scenarios/drop_in_runs.py --devices 2 --out r.json --workdir DIR --scenarios lightning_dp1_tp2,ours_dp1_tp2
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from common import LogLines, StepRecorder, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist import FSDP2Strategy, TensorParallelStrategy

STEPS, SAVED_AT, GLOBAL_BATCH, DIM = 6, 3, 8, 16
SAMPLES = SAVED_AT * GLOBAL_BATCH  # the step-3 save is at an epoch's last batch: a resume continues exactly


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LightningDocsModel(L.LightningModule):
    """Lightning's tensor-parallel example: feed-forward blocks parallelized by hand in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(FeedForward(DIM, 4 * DIM) for _ in range(2))
        self.double()

    def configure_model(self) -> None:
        tp_mesh = self.device_mesh["tensor_parallel"]
        dp_mesh = self.device_mesh["data_parallel"]
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
        for block in self.blocks:
            parallelize_module(block, tp_mesh, plan)
            fully_shard(block, mesh=dp_mesh)
        fully_shard(self, mesh=dp_mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, target = batch
        for block in self.blocks:
            x = x + block(x)
        return F.mse_loss(x, target)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(SAMPLES, DIM, generator=generator, dtype=torch.float64),
                             torch.randn(SAMPLES, DIM, generator=generator, dtype=torch.float64))  # fmt: skip
        dp = self.trainer.strategy.distributed_sampler_kwargs["num_replicas"]
        return DataLoader(data, batch_size=GLOBAL_BATCH // dp)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(devices: int, strategy: Any, workdir: str, name: str, resume: str | None = None) -> dict[str, Any]:
    recorder = StepRecorder()
    saves = ModelCheckpoint(dirpath=f"{workdir}/{name}", every_n_train_steps=SAVED_AT, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="32-true", enable_checkpointing=True,
                                         callbacks=[recorder, saves]), max_steps=STEPS)  # fmt: skip
    L.seed_everything(0, verbose=False)
    log = LogLines("configure_model")
    trainer.fit(LightningDocsModel(), ckpt_path=resume)
    log.close()
    return {"losses": recorder.losses, "log": log.lines}


def _both(dp: int, tp: int) -> dict[str, Callable[[int, str], dict[str, Any]]]:
    """Lightning's strategy and ours with the same arguments; each also resumed from the other's step-3 save."""
    lightning = lambda: ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)  # noqa: E731
    ours = lambda: TensorParallelStrategy(data_parallel_size=dp, tensor_parallel_size=tp)  # noqa: E731
    mesh = f"dp{dp}_tp{tp}"
    return {
        f"lightning_{mesh}": lambda d, w: _fit(d, lightning(), w, f"lightning_{mesh}"),
        f"ours_{mesh}": lambda d, w: _fit(d, ours(), w, f"ours_{mesh}"),
        f"ours_resumes_lightning_{mesh}": lambda d, w: _fit(
            d, ours(), w, f"ours_from_lightning_{mesh}", f"{w}/lightning_{mesh}/step={SAVED_AT}.ckpt"),
        f"lightning_resumes_ours_{mesh}": lambda d, w: _fit(
            d, lightning(), w, f"lightning_from_ours_{mesh}", f"{w}/ours_{mesh}/step={SAVED_AT}.ckpt"),
    }


def _gpt_fit(devices: int, workdir: str, strategy: Any) -> dict[str, Any]:
    from common import make_model_and_data  # type: ignore[import-not-found]

    model, data = make_model_and_data(devices, n_layer=4)
    recorder, log = StepRecorder(), LogLines("fsdp2")
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="64-true", limit_val_batches=0,
                                         callbacks=[recorder]), max_steps=3)  # fmt: skip
    trainer.fit(model, data)
    log.close()
    path = Path(workdir) / f"gpt_{devices}.ckpt"
    trainer.save_checkpoint(path)
    return {"losses": recorder.losses, "log": log.lines, "file": path.is_file(), "folder": path.is_dir()}


def fsdp_arguments(devices: int, workdir: str) -> dict[str, Any]:
    """Lightning's FSDP docs' arguments, the class name changed to FSDP2Strategy."""
    from torch.distributed.fsdp import CPUOffload

    from examples.gpt import Block

    strategy = FSDP2Strategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block},
                             activation_checkpointing_policy={Block}, state_dict_type="full",
                             cpu_offload=CPUOffload(offload_params=False), limit_all_gathers=True)  # fmt: skip
    return _gpt_fit(devices, workdir, strategy)


class HFLlama(L.LightningModule):
    """A stock ``LlamaForCausalLM`` (tiny config, fp64) as a user wraps it."""

    def __init__(self) -> None:
        super().__init__()
        from models import tiny_hf_causal_lm  # type: ignore[import-not-found]

        torch.manual_seed(0)
        self.model = tiny_hf_causal_lm("llama").double()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def hugging_face_plan(devices: int, workdir: str) -> dict[str, Any]:
    """The stock Llama trained with its own shipped plan (``plan="model"``, tp2), or in one process (devices=1)."""
    from common import SEQ_LEN, OneProcessData  # type: ignore[import-not-found]

    from examples.data import TextDataModule

    data = (OneProcessData if devices == 1 else TextDataModule)(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH,
                                                                 train_samples=64, val_samples=4)  # fmt: skip
    strategy = TensorParallelStrategy(tensor_parallel_size=2, plan="model") if devices > 1 else "auto"
    recorder, log = StepRecorder(), LogLines("plan")
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="64-true", limit_val_batches=0,
                                         callbacks=[recorder]), max_steps=3)  # fmt: skip
    L.seed_everything(0, verbose=False)
    trainer.fit(HFLlama(), data)
    log.close()
    return {"losses": recorder.losses, "log": log.lines}


#: activation_checkpointing as users ask for it (issue 55): every k-th unit, selective (per op), by classes.
CHECKPOINTING_MODES = {"every_2nd": 2, "selective": "selective", "by_class": ["MLP"]}


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "hugging_face_plan": hugging_face_plan,
    **{f"checkpointing_{name}": (lambda mode: lambda d, w: _gpt_fit(d, w, FSDP2Strategy(activation_checkpointing=mode)))(
        mode) for name, mode in CHECKPOINTING_MODES.items()},  # fmt: skip
    **_both(1, 2),
    **_both(2, 2),
    "fsdp_arguments": fsdp_arguments,
    "one_process": lambda d, w: _gpt_fit(d, w, "auto"),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
