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
from models import HFLlama, LitGPTLM  # type: ignore[import-not-found]

from lightning_dist import ContextParallelStrategy, FSDP2Strategy, Hybrid3DStrategy
from lightning_dist.parallel.context_parallel.dispatch import ContextParallelAttention, shard_sequence

STEPS = 4


def _trainer(devices: int, strategy: Any, callbacks: list[Callback]) -> L.Trainer:
    return L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", callbacks=callbacks),
        max_steps=STEPS,
        val_check_interval=STEPS,
        limit_predict_batches=2,
    )


def _model_and_data(
    devices: int, dp: int, hf: dict[str, Any] | None, litgpt: bool = False, **data: Any
) -> tuple[L.LightningModule, Any]:
    model, data = make_model_and_data(devices, dp_size=dp, **data)
    if hf is not None:
        L.seed_everything(1234, verbose=False)
        model = HFLlama(data.vocab_size, **hf)
    if litgpt:  # litgpt's GPT: RoPE from its cos/sin tables sliced [:T]; input_pos means KV-cache inference
        L.seed_everything(1234, verbose=False)
        model = LitGPTLM(SEQ_LEN)
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
    devices: int,
    strategy: Any,
    hf: dict[str, Any] | None = None,
    dp: int = 1,
    probe: Callback | None = None,
    litgpt: bool = False,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[torch.Tensor]]:
    model, data = _model_and_data(devices, dp, hf, litgpt)
    recorder = StepRecorder()
    trainer = _trainer(devices, strategy, [recorder] if probe is None else [recorder, probe])
    trainer.fit(model, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
    # predictions are compared at cp=2 (at dp > 1 each replica predicts other samples; a 4-process predict costs
    # seconds of suite time on 2 cores)
    predict = hf is None and not litgpt and devices <= 2
    predictions = trainer.predict(model, dataloaders=data.val_dataloader()) if predict else []
    result = {"losses": recorder.losses, "grad_norms": recorder.grad_norms, "val": metrics}
    return result, full_state(model), [p.cpu() for p in predictions[:2]]


def reference(
    devices: int, workdir: str, name: str = "reference", hf: dict[str, Any] | None = None, litgpt: bool = False
) -> dict[str, Any]:
    """One process, the whole sequence: what every cp run must match."""
    result, state, predictions = _run(devices, "auto", hf, litgpt=litgpt)
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
    litgpt: bool = False,
    **options: Any,
) -> dict[str, Any]:
    strategy = (control or ContextParallelStrategy)(**options)
    later = LaterBatchProbe() if probe else None
    dp = options.get("data_parallel_shard_size", 1)
    with attention_calls() as calls:
        result, state, predictions = _run(devices, strategy, hf, dp, later, litgpt)
    result["attention_heads"] = sorted(calls["heads"])
    result["explicit_mask_seen"] = any(calls["masked"])
    if later is not None:
        result["later_batches"] = later.seen
    expected = torch.load(f"{workdir}/{reference}.pt")
    if strategy.parallel_dims.pp > 1:  # a rank holds its stage's parameters: compared there, the maximum over ranks
        diff = max((v - expected["state"][k]).abs().max().item() for k, v in state.items())
        held = torch.tensor([diff, len(state) / strategy.parallel_dims.cp])  # cp ranks of a stage hold the same
        torch.distributed.all_reduce(held[:1], op=torch.distributed.ReduceOp.MAX)
        torch.distributed.all_reduce(held[1:])
        result["param_diff"], result["same_keys"] = held[0].item(), round(held[1].item()) == len(expected["state"])
    else:
        result["param_diff"] = max((state[k] - v).abs().max().item() for k, v in expected["state"].items())
        result["same_keys"] = sorted(state) == sorted(expected["state"])
    result["prediction_shapes"] = [list(p.shape) for p in predictions]
    result["predictions_equal"] = all(torch.equal(p, q) for p, q in zip(predictions, expected["predictions"]))
    result["positions"] = strategy._positions
    result["rope_tables"] = strategy._rope_tables
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
    """The context-parallel benchmark's counts (benchmarks/studies/context_parallel.py) at a small size, in the process group
    the Trainers of this launch left initialized."""
    from benchmarks.studies import Shape
    from benchmarks.studies import measure_context_parallel as measure

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


# ---------------------------------------------------------------------------------------------- refusals after launch
class PooledClassifier(L.LightningModule):
    """Token ids → embedding → mean over the sequence → 3 classes (a sequence classifier): under cp each rank would
    pool only its shard. The batch holds token sequences, so only the first step can tell."""

    def __init__(self, vocab_size: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(dim=1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch["input_ids"]
        return torch.nn.functional.cross_entropy(self(x), x[:, 0] % 3)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Sets(torch.utils.data.Dataset):
    """Sets of 16 points in 4-D, a regression target per set."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        x = torch.randn(16, 4, generator=generator, dtype=torch.float64)
        return {"x": x, "y": x.sum()}


class SetModel(L.LightningModule):
    """Mean-pooled over the 16 points of each set (a Deep Sets model); ``features=True`` flattens each sample into
    a feature vector ``(B, 64)`` in its own ``train_dataloader`` (data the launching process does not read)."""

    def __init__(self, features: bool = False) -> None:
        super().__init__()
        self.features = features
        self.encode = torch.nn.Linear(64 if features else 4, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encode(x)
        return self.head(h if self.features else h.mean(dim=1)).squeeze(-1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x = batch["x"].flatten(1) if self.features else batch["x"]
        return torch.nn.functional.mse_loss(self(x), batch["y"])

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        if not self.features:
            raise RuntimeError("the set scenario passes its dataloader to fit")
        sets = _Sets()
        data = [{"x": sets[i]["x"].flatten(), "y": sets[i]["y"]} for i in range(len(sets))]
        return torch.utils.data.DataLoader(data, batch_size=4)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class OptimizerSteps(Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.count += 1


def refused(devices: int, workdir: str, case: str) -> dict[str, Any]:
    """A model or batch that context parallelism cannot train, refused on every rank after launch: the error, the
    optimizer steps taken before it, and whether the run left its default_root_dir behind."""
    if case == "pooled_classifier":
        model, data = PooledClassifier(), make_model_and_data(devices, dp_size=1)[1]
        strategy, fit_args = ContextParallelStrategy(), {"datamodule": data}
    elif case == "declared_set":  # sequence_keys says the points are a sequence: the pooled output is refused
        model, strategy = SetModel(), ContextParallelStrategy(sequence_keys=["x"])
        fit_args = {"train_dataloaders": torch.utils.data.DataLoader(_Sets(), batch_size=4)}
    elif case == "hf_labels_pp2_cp2":  # labels= reach a Hugging Face causal LM's forward under pp × cp
        data = make_model_and_data(devices, dp_size=1)[1]
        L.seed_everything(1234, verbose=False)
        model, fit_args = HFLlama(data.vocab_size), {"datamodule": data}
        strategy = Hybrid3DStrategy(pipeline_parallel_size=2, context_parallel_size=2)
    else:  # features: the LightningModule's own train_dataloader, so the first batch is checked after launch
        model, strategy, fit_args = SetModel(features=True), ContextParallelStrategy(), {}
    steps, root = OptimizerSteps(), Path(workdir, f"refused_{case}")
    trainer = L.Trainer(
        **trainer_kwargs(devices, strategy=strategy, precision="64-true", callbacks=[steps]),
        max_steps=1,
        default_root_dir=str(root),
    )
    try:
        trainer.fit(model, **fit_args)
    except ValueError as err:
        return {"error": type(err).__name__, "message": str(err), "optimizer_steps": steps.count,
                "directory_left": root.exists()}  # fmt: skip
    return {"error": None, "optimizer_steps": steps.count}


SCENARIOS: dict[str, Callable[[int, str], dict[str, Any]]] = {
    "reference": reference,
    "litgpt_reference": partial(reference, name="litgpt_reference", litgpt=True),
    **{
        f"litgpt_{attention}": partial(context_parallel, reference="litgpt_reference", litgpt=True, attention=attention)
        for attention in ("ring", "allgather", "ulysses")
    },
    **{
        f"refused_{case}": partial(refused, case=case)
        for case in ("pooled_classifier", "declared_set", "features", "hf_labels_pp2_cp2")
    },
    "litgpt_pp2_cp2": partial(
        context_parallel,
        reference="litgpt_reference",
        litgpt=True,
        control=Hybrid3DStrategy,
        pipeline_parallel_size=2,
        context_parallel_size=2,
    ),
    # a stock LlamaForCausalLM called without labels (loss from its logits; the batch has a key "labels") at pp2 × cp2
    "hf_logits_reference": partial(reference, name="hf_logits_reference", hf={"logits_loss": True}),
    "hf_logits_pp2_cp2": partial(
        context_parallel,
        reference="hf_logits_reference",
        hf={"logits_loss": True},
        control=Hybrid3DStrategy,
        pipeline_parallel_size=2,
        context_parallel_size=2,
    ),
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
