"""The callback verify adds to both runs: it gives the module the shared initial weights, gives the reference the
strategy's global batch (:mod:`~lightning_dist.verification.data`), and records on every rank what the comparison
needs (``<workdir>/<role>/rank<r>.pt``), the samples of every training batch included.

Every hook here runs on every rank, because reading a logged value synced with ``sync_dist=True`` and reading a
sharded tensor whole are collectives.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dist.verification.calls import record_calls
from lightning_dist.verification.data import (
    batch_size,
    leaves,
    reference_loaders,
    samplers_kept,
    sample_fingerprints,
    wrap_dataloader_hooks,
)
from lightning_dist.verification.tensors import (
    full_gradients,
    full_optimizer_state,
    full_parameters,
    load_initial_weights,
    load_training_state,
    merge_anchors,
    zero_dropout,
)

#: ``anchoring`` of the strategy's run: record its parameters and optimizer states at each anchor.
RECORD = "record"
#: ``anchoring`` of the reference: keep its own state at each anchor, then continue from the strategy's.
FOLLOW = "follow"


class VerifyRecorder(Callback):
    """Records one run of ``lightning-dist verify`` (see :mod:`lightning_dist.verification`).

    Args:
        workdir: The verify run's folder; this run writes ``<workdir>/<role>/``.
        role: ``"candidate"`` (the strategy under test) or ``"reference"``.
        candidate_replicas: The reference's: how many data-parallel ranks the strategy's run had (0: the candidate).
        candidate_batches: The reference's: the strategy's global batch per loader (``"train"``, ``"val"``: a list,
            one entry per loader), which the reference's ranks read together in each step.
        candidate_kept: The reference's: per loader (as ``candidate_batches``), whether the strategy's ranks read it
            with the user's own sampler (Lightning did not replace it): the reference's then keeps the user's too.
        keep_dropout: Leave dropout on (its draws cannot agree between layouts, so verify zeroes it by default).
        save_checkpoint: Save a checkpoint at the end (the candidate's, for the round trip).
        float8: The reference's: the strategy's ``float8`` recipe and skip patterns, applied to the module here the
            way the strategy applies them, so that verify compares the parallelism, not FP8 with the base precision.
        anchoring: ``"record"`` (the strategy's run) keeps its parameters and optimizer states at each anchor: the
            first training batch after an optimizer step, and the start of validation. ``"follow"`` (the reference)
            keeps its own there (what its steps made of the state it was given), then continues from the
            strategy's, so that each of its steps starts where the strategy's did. ``""``: neither.
    """

    def __init__(
        self,
        workdir: str,
        role: str,
        candidate_replicas: int = 0,
        candidate_batches: dict[str, list[int | None]] | None = None,
        candidate_kept: dict[str, list[bool]] | None = None,
        keep_dropout: bool = False,
        save_checkpoint: bool = False,
        float8: dict[str, Any] | None = None,
        anchoring: str = "",
    ) -> None:
        self.folder = Path(workdir) / role
        self.initial = Path(workdir) / "initial.pt"
        self.candidate_replicas = candidate_replicas
        self.candidate_batches = candidate_batches or {}
        self.candidate_kept = candidate_kept or {}
        self.keep_dropout = keep_dropout
        self.save_checkpoint = save_checkpoint
        self.float8 = float8
        self.anchoring = anchoring
        self.record: dict[str, Any] = {"logged": [], "losses": [], "steps": [], "dropout_zeroed": [], "calls": []}
        self.record["samples"] = []  # per training batch, its samples' fingerprints as the loader gave them
        self.record.update({"anchors": {}, "after": []} if anchoring else {})
        self._anchors: dict[str, Any] = {}  # the reference's: the strategy's states, by moment
        self._since_anchor: list[tuple[int, int]] = []  # the optimizer steps taken since the last anchor
        self._optimizer_steps: dict[int, int] = {}
        self._batch_idx = self._batches = 0
        self._tracing = ExitStack()
        self._loader_batches: dict[str, list[int | None]] = {}  # per stage, the batch size of each loader
        self._returned: dict[str, Any] = {}  # per stage, the loaders the user's hook returned
        self._loader_kept: dict[str, list[bool]] = {}  # per stage, whether Lightning kept each loader's sampler
        self._trainer: pl.Trainer | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        configure_model = pl_module.configure_model
        device = trainer.strategy.root_device.type

        def configure_then_load() -> None:  # Lightning calls it just before the strategy parallelizes the module
            configure_model()
            load_initial_weights(pl_module, torch.load(self.initial, map_location="cpu", weights_only=True))
            if not self.keep_dropout:
                self.record["dropout_zeroed"] = zero_dropout(pl_module)
            if self.float8:
                self.record["float8"] = convert_like_the_strategy(pl_module, self.float8, device)

        pl_module.configure_model = configure_then_load  # type: ignore[method-assign]
        change = self._reference_loaders if self.candidate_replicas else self._count_batches
        wrap_dataloader_hooks([trainer.datamodule, pl_module], change)
        self._record_samples(trainer)
        if self.anchoring == FOLLOW:
            self._anchors = merge_anchors(load_records(self.folder.parent / "candidate"))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        self._note_kept_samplers("train", trainer.train_dataloader)
        self.record["meta"] = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "replicas": _replicas(trainer),
            "data_parallel_rank": _data_parallel_rank(trainer),
            "loader_batches": self._loader_batches,
            "loader_kept": self._loader_kept,  # the training loaders' now, the validation loaders' at validation
            "strategy": type(strategy).__name__,
            "mesh": str(getattr(strategy, "parallel_dims", "")),
            "precision": str(trainer.precision),
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
        }

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_idx = self._batches  # counted over epochs: batch_idx starts again at 0 in each
        self._batches += 1
        self._anchor(trainer, pl_module, f"train batch {self._batch_idx}")
        if self._batch_idx == 0:  # the first step's module calls and their shapes (see causes.reduced_before)
            self.record["calls"] = self._tracing.enter_context(record_calls(pl_module))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._tracing.close()
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor):
            loss = float(trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean"))
        self.record["losses"].append(loss)
        self._log_values(trainer, f"train batch {self._batch_idx}")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        index = _optimizer_index(trainer, optimizer)
        step = self._optimizer_steps[index] = self._optimizer_steps.get(index, -1) + 1
        self._since_anchor.append((index, step))
        self.record["steps"].append(
            {
                "optimizer": index,
                "step": step,
                "batch": self._batch_idx,
                "lrs": [float(group["lr"]) for group in optimizer.param_groups],
                "grads": full_gradients(pl_module),
            }
        )

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note_kept_samplers("val", trainer.val_dataloaders)
        if not trainer.sanity_checking:
            self._anchor(trainer, pl_module, f"validation after step {trainer.global_step}")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._log_values(trainer, f"validation after step {trainer.global_step}")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_values(trainer, "end of training")
        if self.anchoring == FOLLOW:
            self._anchor(trainer, pl_module, "end of training")
            # the state its own last steps made: after a validation anchor, the module holds the strategy's
            last = self.record["after"][-1] if self.record["after"] else None
            self.record["params"] = last["params"] if last else full_parameters(pl_module)
            self.record["optimizers"] = last["optimizers"] if last else self._optimizer_states(trainer, pl_module)
        else:
            self.record["params"] = full_parameters(pl_module)
            self.record["optimizers"] = self._optimizer_states(trainer, pl_module)
        if self.save_checkpoint:
            trainer.save_checkpoint(self.folder / "checkpoint")
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{trainer.global_rank}.pt"
        torch.save(self.record, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)

    def _count_batches(self, stage: str, loaders: Any) -> Any:
        """The strategy's run: note the batch size of each loader the user's hook returned on this rank."""
        self._loader_batches[stage] = [batch_size(loader) for loader in leaves(loaders)]
        self._returned[stage] = loaders
        return loaders

    def _note_kept_samplers(self, stage: str, used: Any) -> None:
        """The strategy's run: whether Lightning runs the loaders of ``stage`` with the samplers the hook gave."""
        if not self.candidate_replicas and stage in self._returned and stage not in self._loader_kept:
            self._loader_kept[stage] = samplers_kept(self._returned[stage], used)

    def _reference_loaders(self, stage: str, loaders: Any) -> Any:
        """The reference: the user's loaders reading the strategy's global batch per step (see ``data.py``)."""
        assert self._trainer is not None
        ranks = _replicas(self._trainer)
        targets, kept = self.candidate_batches.get(stage, []), self.candidate_kept.get(stage)
        return reference_loaders(loaders, targets, ranks, same_ranks=ranks == self.candidate_replicas, kept=kept)

    def _record_samples(self, trainer: pl.Trainer) -> None:
        """Fingerprint every training batch as the loader gave it, before the strategy transforms it (context
        parallel shards the sequences): the strategy's ``batch_to_device`` is wrapped on this instance."""
        self._trainer = trainer
        strategy = trainer.strategy
        to_device = strategy.batch_to_device

        def batch_to_device(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if trainer.training:
                self.record["samples"].append(sample_fingerprints(batch))
            return to_device(batch, *args, **kwargs)

        strategy.batch_to_device = batch_to_device  # type: ignore[method-assign]

    def _anchor(self, trainer: pl.Trainer, pl_module: pl.LightningModule, moment: str) -> None:
        """At ``moment``, if an optimizer step was taken since the last one: the strategy's run keeps its state;
        the reference keeps its own, then loads the strategy's (there is none to load at the end of training)."""
        if not self.anchoring or not self._since_anchor:
            return
        state = {"params": full_parameters(pl_module), "optimizers": self._optimizer_states(trainer, pl_module)}
        if self.anchoring == RECORD:
            if moment != "end of training":  # the final state is the record's own "params" and "optimizers"
                self.record["anchors"][moment] = state
        else:
            self.record["after"].append({"moment": moment, "steps": list(self._since_anchor), **state})
            if moment in self._anchors:
                load_training_state(pl_module, trainer.optimizers, self._anchors[moment])
        self._since_anchor = []

    @staticmethod
    def _optimizer_states(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[dict[str, Any]]:
        return [full_optimizer_state(pl_module, optimizer) for optimizer in trainer.optimizers]

    def _log_values(self, trainer: pl.Trainer, when: str) -> None:
        values = {
            name: float(value)
            for name, value in trainer.callback_metrics.items()
            if isinstance(value, Tensor) and value.numel() == 1
        }
        self.record["logged"].append({"when": when, "step": trainer.global_step, "values": values})


def load_records(folder: Path) -> list[dict[str, Any]]:
    """The records of a finished run (``rank<r>.pt`` in ``folder``), in rank order."""
    paths = sorted(folder.glob("rank*.pt"), key=lambda p: int(p.stem[4:]))
    return [torch.load(path, map_location="cpu", weights_only=True) for path in paths]


def _optimizer_index(trainer: pl.Trainer, optimizer: Optimizer) -> int:
    for index, candidate in enumerate(trainer.optimizers):
        if candidate is optimizer or getattr(candidate, "optimizer", None) is optimizer:
            return index
    return 0


def convert_like_the_strategy(module: Module, float8: dict[str, Any], device: str) -> str:
    """The strategy's FP8 conversion, applied to the reference's module (emulated off CUDA); its log line."""
    from lightning_dist.parallel.float8 import Float8Settings, convert_to_float8
    from lightning_dist.parallel.model_structure import recognize

    settings = Float8Settings(
        recipe=float8["recipe"],
        skip=tuple(float8["skip"]),
        emulate=device != "cuda",
        head=recognize(module).output_head,
    )
    return convert_to_float8(module, settings).describe()


def _data_parallel_rank(trainer: pl.Trainer) -> int:
    """This rank's place among the data-parallel ranks (its sampler's ``rank``): peers under tensor, context or
    pipeline parallelism share it."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", 0))


def _replicas(trainer: pl.Trainer) -> int:
    """The data-parallel ranks of ``trainer``'s strategy: the number of different batches one step reads."""
    kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("num_replicas", 1))
