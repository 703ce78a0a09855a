"""The step protocol of the shared base, on real processes: train_context() spans forward and backward (activation
checkpoint recompute runs inside it), and with pipeline stages (a pp axis) reduce() hands every rank the loss stage's
value and gradient norms sum over the stages.

The scenario hand_pipeline runs a hand-written 2-rank pipeline over the step protocol (not the pipeline strategy):
the example GPT cut into four stages in place, two per rank (rank r holds stages r and r + 2, as an interleaved
schedule places them), run with plain send/recv through ``run_training_step`` and ``run_backward``.

It checks what the base does for a rank that holds several model parts and only its stages' parameters: the
optimizer sees the local parameters, clipping uses the norm over both stages, logged values come from the loss stage,
a sharded checkpoint saves and loads strictly (keys checked over both stages), and a full-state save gathers every
stage into one file.

python tests/scenarios/protocol_runs.py --devices 2 --out r.json --workdir DIR --scenarios recompute,stages
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import StepRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.nn import Module

from lightning_dist import FSDP2Strategy
from lightning_dist.parallel.grad_clip import total_grad_norm
from lightning_dist.strategies.base import MeshParallelStrategy, MeshSize

ACTIVE = {"train_context": False}


@contextmanager
def _flag() -> Iterator[None]:
    ACTIVE["train_context"] = True
    try:
        yield
    finally:
        ACTIVE["train_context"] = False


class ProbedFSDP2(FSDP2Strategy):
    """fsdp2 whose train_context sets a flag, as loss parallel or context parallel would enter their contexts."""

    def train_context(self) -> ExitStack:
        stack = super().train_context()
        stack.enter_context(_flag())
        return stack


def recompute(devices: int, workdir: str) -> dict[str, Any]:
    """Which block forwards (first passes and activation-checkpoint recomputes) ran inside train_context."""
    model, data = make_model_and_data(devices)
    seen: list[tuple[bool, bool]] = []  # (inside train_context, grad enabled) per block forward
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: seen.append((ACTIVE["train_context"], torch.is_grad_enabled())))
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=ProbedFSDP2(activation_checkpointing=True), limit_val_batches=1),
        max_steps=2,
        val_check_interval=2,
    )
    trainer.fit(model, data)
    return {"seen": seen, "blocks": len(model.blocks), "open_after_fit": ACTIVE["train_context"]}


class TwoStages(MeshParallelStrategy):
    """The mesh of a 2-stage pipeline (pp=2) without a pipeline: enough to check what the base does per stage."""

    log_name = "stages"

    def mesh_sizes(self) -> dict[str, MeshSize]:
        return {"pp": "auto"}

    def parallelize(self, model: Module) -> Module:
        return model


class _StageChecks(Callback):
    def __init__(self) -> None:
        self.result: dict[str, Any] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        rank = dist.get_rank()
        # only the last stage (rank 1) holds the true loss; stage 0 holds a placeholder
        self.result["reduced"] = float(strategy.reduce(torch.tensor(10.0 if rank == 1 else -1.0)))
        # stage r holds a gradient of (r + 1) in 4 elements: the norm over both stages is sqrt(4 + 16)
        p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
        p.grad = torch.full((4,), float(rank + 1), dtype=torch.float64)
        self.result["stage_norm"] = float(total_grad_norm([p]))
        self.result["global_norm"] = float(total_grad_norm([p], stage_group=strategy.process_group("pp")))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.result)
        self.result = {"per_rank": gathered}


def stages(devices: int, workdir: str) -> dict[str, Any]:
    model, data = make_model_and_data(devices, dp_size=1)
    checks = _StageChecks()
    trainer = L.Trainer(**trainer_kwargs(devices, strategy=TwoStages()), max_steps=1, callbacks=[checks])
    trainer.fit(model, data)
    return checks.result


PIPELINE_STEPS, RESUME_AT, CLIP = 5, 3, 0.05


def _pipeline_trainer(devices: int, strategy: Any, max_steps: int, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        **trainer_kwargs(
            devices, strategy=strategy, precision="64-true", gradient_clip_val=CLIP, limit_val_batches=0, **kwargs
        ),
        max_steps=max_steps,
    )


# The four stages, each a list of the GPT's module names, in forward order.
STAGES = [["tok_emb", "pos_emb", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "ln_f", "head"]]


class HandPipeline(MeshParallelStrategy):
    """pp=2: this rank runs stages ``rank`` and ``rank + 2``; activations and their gradients travel by send/recv."""

    log_name = "hand_pipeline"

    def mesh_sizes(self) -> dict[str, MeshSize]:
        return {"pp": 2}

    def parallelize(self, model: nn.Module) -> nn.Module:
        rank = dist.get_rank(self.process_group("pp"))
        self._local = [s for s in range(len(STAGES)) if s % 2 == rank]
        for stage, names in enumerate(STAGES):
            if stage not in self._local:
                for name in names:  # cut in place: the parameters of other stages leave the LightningModule
                    parent, _, child = name.rpartition(".")
                    setattr(model.get_submodule(parent) if parent else model, child, nn.Identity())
        self.model_parts = [nn.ModuleList(model.get_submodule(n) for n in STAGES[s]) for s in self._local]
        return model

    # ------------------------------------------------------------------ the schedule: one forward, one backward
    def _run_stage(self, stage: int, x: Tensor, batch: dict[str, Tensor]) -> Tensor:
        model = self.lightning_module
        if stage == 0:
            ids = batch["input_ids"]
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            x = model.tok_emb(ids) + model.pos_emb(positions)
            names = STAGES[0][2:]
        else:
            names = STAGES[stage]
        for name in names:
            x = model.get_submodule(name)(x)
        return x

    def run_training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Any:
        model, group = self.lightning_module, self.process_group("pp")
        peer = 1 - dist.get_rank(group)
        shape = (*batch["input_ids"].shape, model.hparams.d_model)
        self._saved: list[tuple[int, Tensor | None, Tensor]] = []  # (stage, its input, its output) per local stage
        x: Tensor | None = None
        for stage in self._local:
            if stage > 0:
                x = torch.empty(shape, dtype=torch.float64)
                dist.recv(x, group=group, group_src=peer)
                x.requires_grad_()
            out = self._run_stage(stage, x, batch)
            self._saved.append((stage, x, out))
            if stage < len(STAGES) - 1:
                dist.send(out.detach().contiguous(), group=group, group_dst=peer)
        is_last = self._local[-1] == len(STAGES) - 1
        logits = self._saved[-1][2] if is_last else torch.zeros(*batch["input_ids"].shape, model.hparams.vocab_size)
        model.forward = lambda *args, **kwargs: logits  # the user's training_step, on this stage's output
        try:
            loss = model.training_step(batch, batch_idx)
        finally:
            del model.forward
        shared = self.from_loss_stage(loss)  # every rank returns (and reports) the loss stage's value
        return loss if is_last else shared

    def run_backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        group = self.process_group("pp")
        peer = 1 - dist.get_rank(group)
        for stage, x, out in reversed(self._saved):
            if stage == len(STAGES) - 1:  # the loss's backward, as Lightning runs it (precision, hooks)
                super().run_backward(closure_loss, optimizer, *args, **kwargs)
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, group=group, group_src=peer)
                out.backward(grad)
            if x is not None:
                dist.send(x.grad.contiguous(), group=group, group_dst=peer)
        self._saved = []
        return closure_loss


def reference(devices: int, workdir: str) -> dict[str, Any]:
    """One process, the whole GPT: the losses, gradient norms and final parameters the hand pipeline must match."""
    model, data = make_model_and_data(devices, dp_size=1, n_layer=4)
    recorder = StepRecorder()
    trainer = _pipeline_trainer(devices, "auto", PIPELINE_STEPS, callbacks=[recorder])
    trainer.fit(model, data)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{workdir}/reference.pt")
    return {"losses": recorder.losses, "grad_norms": recorder.grad_norms}


def hand_pipeline(devices: int, workdir: str) -> dict[str, Any]:
    """Train PIPELINE_STEPS steps (saving a sharded checkpoint at RESUME_AT), resume a fresh model from it strictly to
    PIPELINE_STEPS, save one full-state file; compare with the one-process reference (run first, same workdir)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_dist import FullStateCheckpointIO

    first, second = StepRecorder(), StepRecorder()
    model, data = make_model_and_data(devices, dp_size=1, n_layer=4)
    saver = ModelCheckpoint(dirpath=f"{workdir}/pp", every_n_train_steps=RESUME_AT, save_top_k=-1, filename="{step}")
    trainer = _pipeline_trainer(
        devices, HandPipeline(), PIPELINE_STEPS, callbacks=[first, saver], enable_checkpointing=True
    )
    trainer.fit(model, data)
    strategy = trainer.strategy
    parts = [sorted(n for n, _ in part.named_parameters()) for part in strategy.model_parts]
    optimizer_params = sum(p.numel() for g in trainer.optimizers[0].param_groups for p in g["params"])

    model, data = make_model_and_data(devices, dp_size=1, n_layer=4)
    model.strict_loading = True
    trainer = _pipeline_trainer(devices, HandPipeline(checkpoint_io=FullStateCheckpointIO()), PIPELINE_STEPS)
    trainer.callbacks.append(second)
    trainer.fit(model, data, ckpt_path=f"{workdir}/pp/step={RESUME_AT}.ckpt")
    trainer.save_checkpoint(f"{workdir}/full.ckpt")
    expected = torch.load(f"{workdir}/reference.pt")
    local = {k: v.detach() for k, v in model.state_dict().items()}
    local_diff = max((local[k] - expected[k]).abs().max().item() for k in local)
    result: dict[str, Any] = {
        "rank": dist.get_rank(),
        "parts": parts,
        "local_keys": sorted(local),
        "local_numel": sum(v.numel() for v in local.values()),
        "optimizer_numel": optimizer_params,
        "losses": first.losses,
        "resumed_losses": second.losses,
        "param_diff": local_diff,
    }
    if dist.get_rank() == 0:
        full = torch.load(f"{workdir}/full.ckpt", weights_only=False)["state_dict"]
        result["full_keys_match"] = sorted(full) == sorted(expected)
        result["full_diff"] = max((full[k] - expected[k]).abs().max().item() for k in expected)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return {"per_rank": gathered, "model_numel": sum(v.numel() for v in expected.values())}


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "recompute": recompute,
    "stages": stages,
    "reference": reference,
    "hand_pipeline": hand_pipeline,
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
