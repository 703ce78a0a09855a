"""ContextParallelStrategy in a real Trainer: the unchanged example GPT (which builds ``arange`` positions itself when
it gets none) trained at cp=2 with each attention algorithm, against one process on the whole sequence (fp64).

python tests/scenarios/context_parallel_runs.py --devices 1 --out r.json --workdir DIR --scenarios reference
python tests/scenarios/context_parallel_runs.py --devices 2 --out r.json --workdir DIR --scenarios ring,allgather,...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import (  # type: ignore[import-not-found]
    SEQ_LEN,
    StepRecorder,
    full_state,
    make_model_and_data,
    run_scenario_script,
    trainer_kwargs,
)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dist import ContextParallelStrategy, FSDP2Strategy
from lightning_dist.parallel.context_parallel import ContextParallelAttention, shard_sequence

STEPS = 4


def _trainer(devices: int, strategy: Any, callbacks: list[Callback]) -> L.Trainer:
    return L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", callbacks=callbacks),
        max_steps=STEPS,
        val_check_interval=STEPS,
        limit_predict_batches=2,
    )


class HFLlama(L.LightningModule):
    """A stock ``transformers`` ``LlamaForCausalLM`` (4 heads, 2 KV heads) in a plain LightningModule: the labels
    are the inputs, shifted inside the model. ``ignore_below`` > 0 sets the labels of tokens below it to -100
    (an uneven number of ignored labels on each sequence shard)."""

    def __init__(self, vocab_size: int, ignore_below: int = 0) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)
        self.ignore_below = ignore_below

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["input_ids"]
        labels = x.masked_fill(x < self.ignore_below, -100) if self.ignore_below else x
        return self.model(input_ids=x, labels=labels).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _model_and_data(devices: int, dp: int, hf: dict[str, Any] | None, **data: Any) -> tuple[L.LightningModule, Any]:
    model, data = make_model_and_data(devices, dp_size=dp, **data)
    if hf is not None:
        L.seed_everything(1234, verbose=False)
        model = HFLlama(data.vocab_size, **hf)
    return model, data


class LaterBatchProbe(Callback):
    """After the second training step, hands the strategy later batches as Lightning does (``batch_to_device``):
    one of another valid length and one whose length is not divisible by 2·cp."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != 1:
            return
        for length in (24, 30):
            ids = torch.zeros(2, length, dtype=torch.long)
            try:
                shard = trainer.strategy.batch_to_device({"input_ids": ids, "labels": ids})
                self.seen[str(length)] = list(shard["input_ids"].shape)
            except ValueError as err:
                self.seen[str(length)] = str(err)


def _run(
    devices: int, strategy: Any, hf: dict[str, Any] | None = None, dp: int = 1, probe: Callback | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[torch.Tensor]]:
    model, data = _model_and_data(devices, dp, hf)
    recorder = StepRecorder()
    trainer = _trainer(devices, strategy, [recorder] if probe is None else [recorder, probe])
    trainer.fit(model, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    # predictions are compared at cp=2 (at dp > 1 each replica predicts other samples; a 4-process predict costs
    # seconds of suite time on 2 cores)
    predict = hf is None and devices <= 2
    predictions = trainer.predict(model, dataloaders=data.val_dataloader()) if predict else []
    result = {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "val": metrics}
    return result, full_state(model), [p.cpu() for p in predictions[:2]]


def reference(devices: int, workdir: str, name: str = "reference", hf: dict[str, Any] | None = None) -> dict[str, Any]:
    """One process, the whole sequence: what every cp run must match."""
    result, state, predictions = _run(devices, "auto", hf)
    torch.save({"state": state, "predictions": predictions}, f"{workdir}/{name}.pt")
    if hf and hf.get("ignore_below"):
        result["counted_per_shard"] = _counted_labels_per_shard(hf["ignore_below"])
    return result


def _counted_labels_per_shard(ignore_below: int) -> list[int]:
    """How many labels of the first training batch the loss counts on each zigzag shard at cp=2."""
    _, data = make_model_and_data(1, dp_size=1)
    data.setup("fit")
    x = next(iter(data.train_dataloader()))["input_ids"]
    shifted = torch.nn.functional.pad(x[:, 1:].masked_fill(x[:, 1:] < ignore_below, -100), (0, 1), value=-100)
    return [int((shard_sequence(shifted, 2, r) != -100).sum()) for r in range(2)]


@contextmanager
def attention_calls() -> Iterator[dict[str, set]]:
    """What reaches the intercepted SDPA: ``(query heads, key/value heads)`` and whether an explicit mask came."""
    seen: dict[str, set] = {"heads": set(), "masked": set()}
    original = ContextParallelAttention.attention

    def attention(self: ContextParallelAttention, *args: Any, **kwargs: Any) -> torch.Tensor:
        query, key = args[0], args[1]
        seen["heads"].add((query.shape[-3], key.shape[-3]))
        seen["masked"].add(kwargs.get("attn_mask", args[3] if len(args) > 3 else None) is not None)
        return original(self, *args, **kwargs)

    ContextParallelAttention.attention = attention  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        ContextParallelAttention.attention = original  # type: ignore[method-assign]


def context_parallel(
    devices: int,
    workdir: str,
    reference: str = "reference",
    hf: dict[str, Any] | None = None,
    control: type[ContextParallelStrategy] | None = None,
    probe: bool = False,
    **options: Any,
) -> dict[str, Any]:
    strategy = (control or ContextParallelStrategy)(**options)
    later = LaterBatchProbe() if probe else None
    with attention_calls() as calls:
        result, state, predictions = _run(devices, strategy, hf, options.get("data_parallel_shard_size", 1), later)
    result["attention_heads"] = sorted(calls["heads"])
    result["explicit_mask_seen"] = any(calls["masked"])
    if later is not None:
        result["later_batches"] = later.seen
    expected = torch.load(f"{workdir}/{reference}.pt")
    result["param_diff"] = max((state[k] - v).abs().max().item() for k, v in expected["state"].items())
    result["same_keys"] = sorted(state) == sorted(expected["state"])
    result["prediction_shapes"] = [list(p.shape) for p in predictions]
    result["predictions_equal"] = all(torch.equal(p, q) for p, q in zip(predictions, expected["predictions"]))
    result["positions"] = strategy._positions
    result["causal_lm"] = strategy._causal_lm
    result["explicit_masks"] = strategy._explicit_masks
    result["mesh"] = {"cp": strategy.parallel_dims.cp, "dp_shard": strategy.parallel_dims.dp_shard}
    return result


# ---------------------------------------------------------------------------------------------- checkpoints
CKPT_STEPS, SAVE_EVERY, EPOCH_SAMPLES = 6, 3, 32  # 4 steps per epoch: the step-3 checkpoint is mid-epoch


def _fit_checkpointed(
    devices: int, workdir: str, name: str, strategy: Any, dp: int, resume: str | None = None
) -> dict[str, Any]:
    """Fit the GPT to step CKPT_STEPS, a DCP checkpoint every SAVE_EVERY steps in ``workdir/name``; the final
    parameters are saved as ``workdir/name.pt``."""
    model, data = make_model_and_data(devices, dp_size=dp, train_samples=EPOCH_SAMPLES)
    recorder = StepRecorder()
    checkpoints = ModelCheckpoint(
        dirpath=f"{workdir}/{name}", every_n_train_steps=SAVE_EVERY, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", enable_checkpointing=True),
        max_steps=CKPT_STEPS,
        callbacks=[recorder, checkpoints],
    )
    trainer.fit(model, data, ckpt_path=resume)
    state = full_state(model)
    torch.save(state, f"{workdir}/{name}.pt")
    result: dict[str, Any] = {"losses": recorder.losses, "global_step": trainer.global_step}
    result["checkpoint_is_folder"] = Path(workdir, name, f"step={SAVE_EVERY}.ckpt").is_dir()
    if resume is not None:  # against the uninterrupted run of the strategy that saved the checkpoint
        saved_by = torch.load(f"{Path(resume).parent}.pt")
        result["param_diff"] = max((state[k] - v).abs().max().item() for k, v in saved_by.items())
    return result


def checkpointed(devices: int, workdir: str, strategy: str, resume_from: str | None = None) -> dict[str, Any]:
    name = f"ckpt_{strategy}" + (f"_from_{resume_from}" if resume_from else "")
    resume = f"{workdir}/ckpt_{resume_from}/step={SAVE_EVERY}.ckpt" if resume_from else None
    if strategy == "context_parallel":
        return _fit_checkpointed(devices, workdir, name, ContextParallelStrategy(), 1, resume)
    return _fit_checkpointed(devices, workdir, name, FSDP2Strategy(), devices, resume)


def attention_counts(devices: int, workdir: str) -> dict[str, Any]:
    """The context-parallel benchmark's counts (benchmarks/context_parallel.py) at a small size, in the process group
    the Trainers of this launch left initialized."""
    from benchmarks.context_parallel import Shape, measure

    return measure(Shape(seq_len=256, head_dim=16), budget=1 << 18)


class WithoutPositions(ContextParallelStrategy):
    """The control: the model builds its own (local) positions, as it would without the strategy's pre-hook."""

    def _find_positions(self, model: torch.nn.Module) -> None:
        super()._find_positions(model)


class WithoutLabelShift(ContextParallelStrategy):
    """The control: the causal LM shifts its labels within each shard and averages over the shard's own labels."""

    def _recognize_causal_lm(self, model: torch.nn.Module, log: bool = True) -> None:
        super()._recognize_causal_lm(model, log)
        self._causal_lm = None


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "reference": reference,
    "ring": partial(context_parallel, attention="ring", probe=True),
    "allgather_checkpointed": partial(context_parallel, attention="allgather", activation_checkpointing=True),
    "ulysses": partial(context_parallel, attention="ulysses"),
    "without_positions": partial(context_parallel, attention="ring", control=WithoutPositions),
    "hf_reference": partial(reference, name="hf_reference", hf={}),
    "hf_ignore_reference": partial(reference, name="hf_ignore_reference", hf={"ignore_below": 24}),
    **{
        f"hf_{attention}": partial(context_parallel, reference="hf_reference", hf={}, attention=attention)
        for attention in ("ring", "allgather", "ulysses")
    },
    "hf_ignore_ring": partial(context_parallel, reference="hf_ignore_reference", hf={"ignore_below": 24}),
    "hf_ignore_without_label_shift": partial(
        context_parallel, reference="hf_ignore_reference", hf={"ignore_below": 24}, control=WithoutLabelShift
    ),
    "ckpt_context_parallel": partial(checkpointed, strategy="context_parallel"),
    "ckpt_fsdp2": partial(checkpointed, strategy="fsdp2"),
    "resume_context_parallel_under_fsdp2": partial(checkpointed, strategy="fsdp2", resume_from="context_parallel"),
    "resume_fsdp2_under_context_parallel": partial(checkpointed, strategy="context_parallel", resume_from="fsdp2"),
    "attention_counts": attention_counts,
    # 4 processes: cp=4, and 2 data-parallel replicas × cp=2 (FSDP2 over both), against the same references
    **{
        f"{model}_{mesh}_{attention}": partial(
            context_parallel,
            reference=f"{prefix}reference",
            hf={} if model == "hf" else None,
            attention=attention,
            data_parallel_shard_size=dp,
        )
        for model, prefix in (("gpt", ""), ("hf", "hf_"))
        for mesh, dp in (("cp4", 1), ("dp2_cp2", 2))
        for attention in ("ring", "allgather", "ulysses")
        if not (model == "hf" and mesh == "cp4" and attention == "ulysses")  # 2 KV heads cannot split over cp=4
    },
}

if __name__ == "__main__":
    run_scenario_script(SCENARIOS)
