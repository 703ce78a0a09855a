"""PipelineStrategy with a real Trainer against one process: the unchanged example GPT on every schedule family
(pp=2 and pp=4, pp2 × dp2), stock Hugging Face models, and checkpoints resumed across strategies.

python tests/scenarios/pipeline_strategy_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
python tests/scenarios/pipeline_strategy_runs.py --devices 2 --out r.json --workdir DIR --scenarios 1f1b,gpipe

Every pipeline scenario compares with the reference of the same model (``reference_accumulate`` for
``1f1b_accumulate``, ``hf_<model>_reference`` for ``hf_<model>``). ``1f1b`` and ``save_fsdp2`` write the step-2
checkpoints the ``<source>_as_<target>`` scenarios resume; ``1f1b_dp2`` and ``pp4_*`` need 4 processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from common import LogLines, StepRecorder, make_model_and_data, run_scenario_script, trainer_kwargs  # type: ignore[import-not-found]
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from models import HFCausalLM  # type: ignore[import-not-found]
from torch.distributed.tensor import DTensor

from examples.gpt import GPT
from lightning_dist import FSDP2Strategy, Hybrid3DStrategy, PipelineStrategy, TensorParallelStrategy

STEPS, CLIP = 4, 0.05
SAVE_AT = 2  # the resumes start from the checkpoint of step 2 (mid-epoch)
VOCAB = 64  # the data has 63 token ids; 64 lets tensor parallelism divide the vocabulary


class LoggedLoss(Callback):
    """The value this rank logged as ``key`` at every optimizer step (read once Lightning has published it)."""

    def __init__(self, key: str = "train_loss") -> None:
        self.key = key
        self.values: list[float] = []

    def _read(self, trainer: L.Trainer) -> None:
        self.values.append(float(trainer.callback_metrics[self.key]))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step > 0:
            self._read(trainer)

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._read(trainer)


class FirstGradients(Callback):
    """This rank's gradients (unsharded) at the first optimizer step, before clipping, by parameter name."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.grads is None:
            named = pl_module.named_parameters()
            self.grads = {n: _full(p.grad).detach().clone() for n, p in named if p.grad is not None}


def _checkpoints(workdir: str, name: str) -> ModelCheckpoint:
    """Saves at step SAVE_AT (mid-epoch) into ``workdir/name/step=SAVE_AT.ckpt``."""
    return ModelCheckpoint(f"{workdir}/{name}", every_n_train_steps=SAVE_AT, save_top_k=-1, filename="{step}")


def _train(
    devices: int, strategy: Any, dp: int = 1, callbacks: list[Callback] = (), evaluate: bool = True, **kwargs: Any
) -> tuple[Any, StepRecorder, LoggedLoss, dict[str, float], list | None]:
    """Fit STEPS steps (validating after the last); with ``evaluate`` also ``validate`` and ``predict`` afterwards
    (else the validation loss is fit's)."""
    model, data = make_model_and_data(devices, dp_size=dp, n_layer=4, vocab_size=VOCAB)
    recorder, logged, grads = StepRecorder(), LoggedLoss(), FirstGradients()
    recorder.first_grads = grads
    trainer = L.Trainer(
        **trainer_kwargs(
            devices,
            strategy=strategy,
            precision="64-true",
            gradient_clip_val=CLIP,
            enable_checkpointing=bool(callbacks),
        ),
        max_steps=STEPS,
        val_check_interval=STEPS,  # one validation loop inside fit, after the last step
        check_val_every_n_epoch=None,
        callbacks=[recorder, logged, grads, *callbacks],
        **kwargs,
    )
    trainer.fit(model, data)
    if not evaluate:
        return model, recorder, logged, _values(trainer.callback_metrics, ("val_loss", "val_acc")), None
    val = _values(trainer.validate(model, data.val_dataloader(), verbose=False)[0], ("val_loss", "val_acc"))
    predictions = trainer.predict(model, data.val_dataloader())
    return model, recorder, logged, val, predictions


def _values(metrics: Any, keys: tuple[str, ...]) -> dict[str, float]:
    return {k: float(metrics[k]) for k in keys}


def _reference(**kwargs: Any) -> Callable[[int, str], dict[str, Any]]:
    def run(devices: int, workdir: str) -> dict[str, Any]:
        """One process, the whole GPT: losses, gradient norms, final parameters, validation loss, predictions."""
        model, recorder, logged, val, predictions = _train(devices, "auto", **kwargs)
        suffix = "_accumulate" if kwargs else ""
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{workdir}/reference{suffix}.pt")
        torch.save(predictions, f"{workdir}/predictions{suffix}.pt")
        torch.save(recorder.first_grads.grads, f"{workdir}/grads{suffix}.pt")
        return {
            "losses": recorder.losses,
            "grad_norms": recorder.grad_norms,
            "logged": logged.values,
            **val,
            "keys": sorted(model.state_dict()),
            "grad_keys": sorted(recorder.first_grads.grads),
        }

    return run


def _pipeline(
    schedule: str,
    dp: int = 1,
    options: dict[str, Any] | None = None,
    save: bool = False,
    evaluate: bool = True,
    **kwargs: Any,
) -> Callable[[int, str], dict[str, Any]]:
    def run(devices: int, workdir: str) -> dict[str, Any]:
        strategy = PipelineStrategy(schedule=schedule, data_parallel_shard_size=dp, **(options or {}))
        callbacks = [_checkpoints(workdir, "pipeline")] if save else []
        model, recorder, logged, val, predictions = _train(devices, strategy, dp, callbacks, evaluate, **kwargs)
        suffix = "_accumulate" if kwargs else ""
        expected = torch.load(f"{workdir}/reference{suffix}.pt")
        local = {k: _full(v.detach()) for k, v in model.state_dict().items()}
        grads, expected_grads = recorder.first_grads.grads, torch.load(f"{workdir}/grads{suffix}.pt")
        result: dict[str, Any] = {
            "losses": recorder.losses,
            "logged": logged.values,
            **val,
            "keys": sorted(local),
            "param_diff": max((local[k] - expected[k]).abs().max().item() for k in local),
            "grad_diff": max((grads[k] - expected_grads[k]).abs().max().item() for k in grads),
            "grad_keys": sorted(grads),
        }
        if predictions is not None:
            result["has_predictions"] = predictions[0] is not None
        if predictions is not None and predictions[0] is not None:
            ref = torch.load(f"{workdir}/predictions{suffix}.pt")
            result["predictions_equal"] = all(torch.equal(a, b) for a, b in zip(predictions, ref))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return {"per_rank": gathered}

    return run


CHECKPOINT_STRATEGIES: dict[str, tuple[Callable[[], Any], int]] = {  # name: (strategy, data-parallel size)
    "pipeline": (lambda: PipelineStrategy(), 1),
    "fsdp2": (lambda: FSDP2Strategy(), 2),
    "tensor_parallel": (lambda: TensorParallelStrategy(tensor_parallel_size=2), 1),
}


def _resume(source: str | None, target: str) -> Callable[[int, str], dict[str, Any]]:
    """Train under ``target`` from the step-SAVE_AT checkpoint ``source`` saved to step STEPS (``source=None``: save
    that checkpoint, training to step SAVE_AT only). Returns the losses and the gathered final parameters' largest
    difference from the uninterrupted one-process run."""

    def run(devices: int, workdir: str) -> dict[str, Any]:
        make, dp = CHECKPOINT_STRATEGIES[target]
        model, data = make_model_and_data(devices, dp_size=dp, n_layer=4, vocab_size=VOCAB)
        recorder = StepRecorder()
        trainer = L.Trainer(
            **trainer_kwargs(
                devices,
                strategy=make(),
                precision="64-true",
                gradient_clip_val=CLIP,
                limit_val_batches=0,
                enable_checkpointing=not source,
            ),
            max_steps=STEPS if source else SAVE_AT,
            callbacks=[recorder, *([] if source else [_checkpoints(workdir, target)])],
        )
        trainer.fit(model, data, ckpt_path=f"{workdir}/{source}/step={SAVE_AT}.ckpt" if source else None)
        expected = torch.load(f"{workdir}/reference.pt")
        diffs = [(_full(v.detach()) - expected[k]).abs().max().item() for k, v in model.state_dict().items()]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, max(diffs))
        return {"losses": recorder.losses, "param_diff": max(gathered), "params": len(expected)}

    return run


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class TiedCopies(Callback):
    """After every optimizer step, the largest difference between the copies of a tied parameter across ranks."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.diffs: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        local = dict(pl_module.named_parameters())
        mine = next(local[n] for n in self.names if n in local).detach()
        copies = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(copies, mine)
        self.diffs.append(max((c - copies[0]).abs().max().item() for c in copies))


def _hf_train(devices: int, kind: str, strategy: Any) -> tuple[Any, StepRecorder, list[LoggedLoss], TiedCopies | None]:
    _, data = make_model_and_data(devices, dp_size=1)
    L.seed_everything(1234, verbose=False)
    model = HFCausalLM(kind)
    recorder, logged = StepRecorder(), [LoggedLoss("train_loss"), LoggedLoss("loss64")]
    tied = (
        TiedCopies(("model.transformer.wte.weight", "model.lm_head.weight")) if devices > 1 and kind == "gpt2" else None
    )
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", limit_val_batches=0),
        max_steps=STEPS,
        callbacks=[recorder, *logged, *([tied] if tied else [])],
    )
    trainer.fit(model, data)
    return model, recorder, logged, tied


def _hf_reference(kind: str) -> Callable[[int, str], dict[str, Any]]:
    def run(devices: int, workdir: str) -> dict[str, Any]:
        model, recorder, logged, _ = _hf_train(devices, kind, "auto")
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{workdir}/reference_{kind}.pt")
        return {
            "losses": recorder.losses,
            "logged": logged[0].values,
            "logged64": logged[1].values,
            "keys": sorted(model.state_dict()),
        }

    return run


def _hf_pipeline(kind: str) -> Callable[[int, str], dict[str, Any]]:
    def run(devices: int, workdir: str) -> dict[str, Any]:
        model, recorder, logged, tied = _hf_train(devices, kind, PipelineStrategy())
        expected = torch.load(f"{workdir}/reference_{kind}.pt")
        local = {k: v.detach() for k, v in model.state_dict().items()}
        result = {
            "losses": recorder.losses,
            "logged": logged[0].values,
            "logged64": logged[1].values,
            "keys": sorted(local),
            "param_diff": max((local[k] - expected[k]).abs().max().item() for k in local),
            "tied_diffs": tied.diffs if tied else [],
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return {"per_rank": gathered}

    return run


FROZEN = ("tok_emb.", "pos_emb.", "blocks.0.", "blocks.1.")  # stage 0 of the 4-block GPT at pp=2, whole


class FrozenFirstStage(GPT):
    """The GPT fine-tuned with its first pipeline stage frozen, as users write it: ``requires_grad_(False)`` in
    ``__init__`` and the optimizer built from the trainable parameters (an empty list on stage 0)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for name, p in self.named_parameters():
            p.requires_grad_(not name.startswith(FROZEN))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class FrozenGroup(GPT):
    """The same stage frozen in ``on_fit_start`` (after ``configure_optimizers``), the optimizer holding it as a
    param group of its own: each stage then holds one empty param group."""

    def on_fit_start(self) -> None:
        for name, p in self.named_parameters():
            p.requires_grad_(not name.startswith(FROZEN))

    def configure_optimizers(self) -> Any:
        named = list(self.named_parameters())
        groups = [
            {"params": [p for n, p in named if n.startswith(FROZEN)], "lr": 0.0},
            {"params": [p for n, p in named if not n.startswith(FROZEN)]},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class StepCounts(Callback):
    """On this rank: the optimizer's learning rates at the start of every step (what LearningRateMonitor logs; after
    a resume, what the checkpoint restored) and Lightning's global_step after it."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.lrs: list[list[float]] = []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.lrs.append([float(g["lr"]) for g in trainer.optimizers[0].param_groups])

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(trainer.global_step)


def _frozen(kind: str, strategy: Callable[[], Any] | None = None, dp: int = 1, save: bool = False,
            resume: bool = False) -> Callable[[int, str], dict[str, Any]]:  # fmt: skip
    """A GPT with a frozen first stage (``kind``: filter or group; both train the same parameters alike) for STEPS
    clipped steps under ``strategy``: without one, the one-process run, which saves its parameters and first
    gradients for the others to compare with. ``save``: a checkpoint at step SAVE_AT; ``resume``: train from it to
    STEPS."""
    model_class = {"filter": FrozenFirstStage, "group": FrozenGroup}[kind]

    def run(devices: int, workdir: str) -> dict[str, Any]:
        model, data = make_model_and_data(devices, dp_size=dp, n_layer=4, vocab_size=VOCAB, model_class=model_class)
        recorder, counts, grads, lines = StepRecorder(), StepCounts(), FirstGradients(), LogLines("no parameter")
        trainer = L.Trainer(
            **trainer_kwargs(
                devices,
                strategy=strategy() if strategy else "auto",
                precision="64-true",
                gradient_clip_val=CLIP,
                limit_val_batches=0,
                enable_checkpointing=save,
            ),
            max_steps=STEPS,
            callbacks=[recorder, counts, grads, *([_checkpoints(workdir, f"frozen_{kind}")] if save else [])],
        )
        trainer.fit(model, data, ckpt_path=f"{workdir}/frozen_{kind}/step={SAVE_AT}.ckpt" if resume else None)
        lines.close()
        result: dict[str, Any] = {"losses": recorder.losses, "steps": counts.steps, "lrs": counts.lrs}
        if strategy is None:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, f"{workdir}/frozen.pt")
            torch.save(grads.grads, f"{workdir}/frozen_grads.pt")
            return {**result, "keys": sorted(model.state_dict()), "grad_keys": sorted(grads.grads)}
        expected = torch.load(f"{workdir}/frozen.pt")
        local = {k: _full(v.detach()) for k, v in model.state_dict().items()}
        result.update(keys=sorted(local), log=lines.lines)
        result["param_diff"] = max((local[k] - expected[k]).abs().max().item() for k in local)
        if not resume:
            expected_grads = torch.load(f"{workdir}/frozen_grads.pt")
            diffs = [(v - expected_grads[k]).abs().max().item() for k, v in grads.grads.items()]
            result.update(grad_keys=sorted(grads.grads), grad_diff=max(diffs, default=0.0))  # stage 0: none
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        return {"per_rank": gathered}

    return run


PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true")  # 32-true and 64-true: every other scenario


def _precisions(devices: int, workdir: str) -> dict[str, Any]:
    """One training step under each precision flag fsdp2 supports: the loss (one process with ``devices=1``)."""
    losses = {}
    for precision in PRECISIONS:
        model, data = make_model_and_data(devices, dp_size=1, n_layer=2, vocab_size=VOCAB)
        recorder = StepRecorder()
        strategy = PipelineStrategy() if devices > 1 else "auto"
        trainer = L.Trainer(
            **trainer_kwargs(devices, strategy=strategy, precision=precision, limit_val_batches=0),
            max_steps=1,
            callbacks=[recorder],
        )
        trainer.fit(model, data)
        losses[precision] = recorder.losses[0]
    return losses


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "reference": _reference(),
    "reference_accumulate": _reference(accumulate_grad_batches=2),
    "1f1b": _pipeline("1f1b", save=True),  # also saves the checkpoint the resumes below start from
    "gpipe": _pipeline("gpipe"),
    "interleaved_1f1b": _pipeline("Interleaved1F1B", evaluate=False),  # torch's spelling, as torchtitan configs write it
    "zbv_zero_bubble": _pipeline("zbv_zero_bubble"),
    "1f1b_accumulate": _pipeline("1f1b", accumulate_grad_batches=2),
    # 4 processes (fit and its validation only): pp=2 × dp_shard=2, and pp=4 with one block per stage
    "1f1b_dp2": _pipeline("1f1b", dp=2, evaluate=False),
    "pp4_gpipe": _pipeline("gpipe", evaluate=False),
    "pp4_1f1b": _pipeline("1f1b", evaluate=False),
    "1f1b_checkpointing": _pipeline("1f1b", options={"activation_checkpointing": True}, evaluate=False),
    "save_fsdp2": _resume(None, "fsdp2"),
    "pipeline_as_fsdp2": _resume("pipeline", "fsdp2"),
    "pipeline_as_tensor_parallel": _resume("pipeline", "tensor_parallel"),
    "fsdp2_as_pipeline": _resume("fsdp2", "pipeline"),
    "precisions": _precisions,  # with 1 process: the reference
    "hf_llama_reference": _hf_reference("llama"),
    "hf_gpt2_reference": _hf_reference("gpt2"),
    "hf_litgpt_reference": _hf_reference("litgpt"),
    # a frozen first stage: frozen_reference in one process; frozen_<kind> saves the checkpoint _resumed starts from
    "frozen_reference": _frozen("filter"),
    "frozen_filter": _frozen("filter", PipelineStrategy, save=True),
    "frozen_filter_resumed": _frozen("filter", PipelineStrategy, resume=True),
    "frozen_group": _frozen("group", PipelineStrategy, save=True),
    "frozen_group_resumed": _frozen("group", PipelineStrategy, resume=True),
    "frozen_filter_hybrid3d": _frozen(  # 4 processes: pp2 × dp_shard2
        "filter", lambda: Hybrid3DStrategy(pipeline_parallel_size=2, data_parallel_shard_size=2), dp=2
    ),
    "hf_llama": _hf_pipeline("llama"),
    "hf_gpt2": _hf_pipeline("gpt2"),
    "hf_litgpt": _hf_pipeline("litgpt"),
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
