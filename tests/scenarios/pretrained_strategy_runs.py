"""Every strategy started from pretrained weights with ``initial_weights`` (issue 42), 4 processes, fp64.

The test writes the folders first (``<workdir>/llama``: a bf16 ``LlamaForCausalLM`` in 3 shards; ``<workdir>/gpt2``:
a tied ``GPT2LMHeadModel``; ``<workdir>/mixtral``: a ``MixtralForCausalLM``; ``<workdir>/litgpt``: a litgpt folder). After each fit a checkpoint is saved for the
test to export. Each scenario builds :class:`models.PretrainedCausalLM` from the folder's config under
``trainer.init_module(empty_init=True)`` (the meta device: no rank ever holds the model whole), fits 3 AdamW steps with
the strategy given ``initial_weights``, and records: which tensors differ from the file's right after the load
(every rank's, whole, in checkpoint row order), each step's loss averaged over the ranks, and the log line. The test
compares the losses with one process that called ``from_pretrained`` on the same global batch of 4.

- ``fsdp2_llama`` (dp_shard 4), ``tp_llama`` (tp 2 × dp 2), ``pp_llama`` (pp 2 × dp 2), ``cp_llama`` (cp 2 × dp 2),
  ``hybrid_llama`` (hybrid3d pp 2 × tp 2);
- ``ep_mixtral``: a stock Mixtral under fsdp2 with expert_parallel_size 2: its file holds one tensor per expert and
  projection (``block_sparse_moe.experts.3.w1.weight``), the model stacked experts (``mlp.experts.gate_up_proj``),
  and each rank reads only its experts' pieces;
- ``fsdp2_litgpt``, ``tp_litgpt``, ``hybrid_litgpt``: a litgpt ``GPT`` (fused ``qkv``) from its ``lit_model.pth``;
- ``pp_gpt2``: GPT-2's embedding tied to its head across the two stages: the last stage's copy (``lm_head.weight``,
  not in the file) is loaded from ``transformer.wte.weight``;
- ``ours_llama``: ``initial_weights`` is fsdp2_llama's (sharded) checkpoint, loaded under tensor_parallel dp2 × tp2:
  its model weights, exactly;
- ``resume_llama``: ``ckpt_path`` (fsdp2_llama's checkpoint) given: the weights come from the checkpoint and
  ``initial_weights`` is not read;
- ``restart_llama``: the restart recipe, ``initial_weights`` with ``ckpt_path="last"``, launched twice (the first
  launch has no ``last`` and reads the weights, the second resumes and does not).

python tests/scenarios/pretrained_strategy_runs.py --devices 4 --out r.json --workdir DIR --scenarios fsdp2_llama,...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import SEQ_LEN, LogLines, StepRecorder, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from models import PretrainedCausalLM, PretrainedLitGPT  # type: ignore[import-not-found]
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from examples.data import TextDataModule
from lightning_dist import (
    ContextParallelStrategy,
    FSDP2Strategy,
    Hybrid3DStrategy,
    PipelineStrategy,
    TensorParallelStrategy,
)

GLOBAL_BATCH, STEPS = 4, 3


class LoadedValues(L.Callback):
    """At fit start, before any step: the names of the tensors that differ from the file's values (as
    ``from_pretrained`` reads them: Mixtral's per-expert tensors stacked), over all ranks."""

    def __init__(self, folder: Path, checkpoint: str | None = None) -> None:
        self.folder = folder
        self.checkpoint = checkpoint  # initial_weights is one of our checkpoints: its model weights are expected
        self.differ: list[str] = []
        self.compared = 0

    def _expected(self, pl_module: L.LightningModule) -> dict[str, torch.Tensor]:
        if self.checkpoint is None:
            return type(pl_module)(str(self.folder), from_pretrained=True).model.state_dict()
        from lightning_dist.checkpoint.consolidate import load_full_checkpoint

        state = load_full_checkpoint(self.checkpoint)["state_dict"]
        return {key.removeprefix("model."): value for key, value in state.items()}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        files = self._expected(pl_module)
        state = get_model_state_dict(pl_module.model)  # checkpoint form: tensor-parallel rows in the file's order
        mine = []
        for name in sorted(state):
            value = state[name]
            full = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()  # collective
            if not torch.equal(full, files[name]):
                mine.append(name)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, len(state)))
        self.differ = sorted({name for names, _ in gathered for name in names})
        self.compared = sum(count for _, count in gathered)


def _fit(
    devices: int, workdir: str, kind: str, strategy: Any, dp: int, ckpt_path: str | None = None, **trainer: Any
) -> dict:
    """Fit, then save a checkpoint (``<workdir>/<kind>_<strategy>.ckpt``: the test exports it); ``trainer``: more
    Trainer arguments (no save then)."""
    folder = Path(workdir) / kind
    L.seed_everything(1234, verbose=False)
    data = TextDataModule(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH // dp, train_samples=64, val_samples=4)
    ours = str(strategy.initial_weights) if str(strategy.initial_weights).endswith(".ckpt") else None
    values, steps = LoadedValues(folder, ours), StepRecorder()
    log = LogLines("initial_weights")
    callbacks = [values, steps, *trainer.pop("callbacks", [])]
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=strategy, precision="64-true", limit_val_batches=0,
                                         callbacks=callbacks, **{"max_steps": STEPS, **trainer}))  # fmt: skip
    with trainer.init_module(empty_init=True):
        module = (PretrainedLitGPT if kind == "litgpt" else PretrainedCausalLM)(str(folder))
    trainer.fit(module, data, ckpt_path=ckpt_path)
    log.close()
    checkpoint = Path(workdir) / f"{kind}_{type(strategy).__name__}.ckpt"
    if ckpt_path is None and ours is None and len(callbacks) == 2:
        trainer.save_checkpoint(checkpoint)
    return {"differ": values.differ, "compared": values.compared, "losses": steps.losses, "log": log.lines,
            "checkpoint": str(checkpoint)}  # fmt: skip


def _resume(devices: int, workdir: str) -> dict:
    """fsdp2_llama's checkpoint (3 steps) resumed with initial_weights still set: not read."""
    ckpt = str(Path(workdir) / "llama_FSDP2Strategy.ckpt")
    run = _fit(devices, workdir, "llama", FSDP2Strategy(initial_weights=_weights("llama", workdir)), 4, ckpt_path=ckpt)
    from lightning_dist.checkpoint.consolidate import load_full_checkpoint

    return {**run, "saved_step": load_full_checkpoint(ckpt)["global_step"]}


def _restart(devices: int, workdir: str) -> dict:
    """The restart recipe: one configuration with ``initial_weights`` and ``ckpt_path="last"``, launched twice. The
    first launch finds no ``last`` checkpoint and starts from the weights (2 of 3 steps, saving ``last`` after each);
    then the weights folder is moved away, and the second launch resumes from ``last`` without reading it."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    weights, checkpoints = Path(workdir) / "restart_weights", Path(workdir) / "restart_checkpoints"

    def launch(max_steps: int) -> dict:
        saves = ModelCheckpoint(dirpath=checkpoints, save_last=True, every_n_train_steps=1, save_top_k=0)
        strategy = FSDP2Strategy(initial_weights=str(weights))
        return _fit(devices, workdir, "llama", strategy, 4, "last", max_steps=max_steps, callbacks=[saves],
                    enable_checkpointing=True)  # fmt: skip

    first = launch(STEPS - 1)
    if dist.get_rank() == 0:
        weights.rename(weights.with_name("restart_weights.moved"))
    dist.barrier()
    return {"first": first, "second": launch(STEPS), "weights_left": weights.exists()}


def _weights(kind: str, workdir: str) -> str:
    return str(Path(workdir) / kind)


SCENARIOS = {
    "fsdp2_llama": lambda d, w: _fit(d, w, "llama", FSDP2Strategy(initial_weights=_weights("llama", w)), 4),
    "tp_llama": lambda d, w: _fit(d, w, "llama", TensorParallelStrategy(
        tensor_parallel_size=2, data_parallel_shard_size=2, initial_weights=_weights("llama", w)), 2),
    "pp_llama": lambda d, w: _fit(d, w, "llama", PipelineStrategy(
        pipeline_parallel_size=2, data_parallel_shard_size=2, initial_weights=_weights("llama", w)), 2),
    "cp_llama": lambda d, w: _fit(d, w, "llama", ContextParallelStrategy(
        context_parallel_size=2, data_parallel_shard_size=2, initial_weights=_weights("llama", w)), 2),
    "hybrid_llama": lambda d, w: _fit(d, w, "llama", Hybrid3DStrategy(
        pipeline_parallel_size=2, tensor_parallel_size=2, initial_weights=_weights("llama", w)), 1),
    "ep_mixtral": lambda d, w: _fit(d, w, "mixtral", FSDP2Strategy(
        expert_parallel_size=2, initial_weights=_weights("mixtral", w)), 4),
    "fsdp2_litgpt": lambda d, w: _fit(d, w, "litgpt", FSDP2Strategy(initial_weights=_weights("litgpt", w)), 4),
    "tp_litgpt": lambda d, w: _fit(d, w, "litgpt", TensorParallelStrategy(
        tensor_parallel_size=2, data_parallel_shard_size=2, initial_weights=_weights("litgpt", w)), 2),
    "hybrid_litgpt": lambda d, w: _fit(d, w, "litgpt", Hybrid3DStrategy(
        pipeline_parallel_size=2, tensor_parallel_size=2, initial_weights=_weights("litgpt", w)), 1),
    "pp_gpt2": lambda d, w: _fit(d, w, "gpt2", PipelineStrategy(
        pipeline_parallel_size=2, data_parallel_shard_size=2, initial_weights=_weights("gpt2", w)), 2),
    "resume_llama": _resume,
    "restart_llama": _restart,
    "ours_llama": lambda d, w: _fit(d, w, "llama", TensorParallelStrategy(  # fsdp2_llama's checkpoint, another mesh
        tensor_parallel_size=2, data_parallel_shard_size=2,
        initial_weights=str(Path(w) / "llama_FSDP2Strategy.ckpt")), 2),
}  # fmt: skip

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
