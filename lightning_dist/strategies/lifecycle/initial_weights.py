"""The ``initial_weights`` option of every strategy: a model starts from pretrained weights read after it was
sharded, each rank reading only the slices it holds (:func:`lightning_dist.checkpoint.pretrained.load_pretrained`).

Before launch, the files are found and, when the model exists already (no ``configure_model``), matched against it
from their headers alone (names, shapes, dtypes), so a folder of another model, a missing shard or a wrong shape is
refused before any process starts. One of our own checkpoints (a sharded folder or a ``.ckpt`` file, from any
strategy and mesh) gives its model weights only, as a resume would load them, without optimizer or loop state. At
setup the weights are loaded after the model was parallelized and materialized (a model built under ``trainer.init_module(empty_init=True)`` never exists whole), before replicated
copies are made equal. A run that restores a checkpoint resumes from it: the checkpoint holds the trained weights,
so ``initial_weights`` is not read (a log line says so). Whether it restores one is decided as Lightning decides it
(:func:`~lightning_dist.compat.lightning.restores_a_checkpoint`): ``ckpt_path="last"`` restores nothing on the first
launch of a restartable job, which then starts from ``initial_weights``, and a YAML that keeps both is right on every
launch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn import Module

from lightning_dist.checkpoint.layout import DCP_INDEX, METADATA_FILENAME
from lightning_dist.checkpoint.model_state import load_checkpoint_into
from lightning_dist.checkpoint.pretrained import (
    check_pretrained_fit,
    load_pretrained,
    read_pretrained_files,
    read_threads,
)
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.compat.lightning import attached_trainer, restores_a_checkpoint

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object


def check_initial_weights(initial_weights: str | os.PathLike | None) -> Path | None:
    """The option as a path (not checked for existence here: the path may only exist where the job runs)."""
    if initial_weights is None:
        return None
    if not isinstance(initial_weights, (str, os.PathLike)) or not str(initial_weights):
        raise TypeError(
            f"initial_weights={initial_weights!r}: expected the path of a Hugging Face model folder or a"
            " *.safetensors file."
        )
    return Path(initial_weights).expanduser()


def is_training_checkpoint(path: Path) -> bool:
    """Whether ``path`` is one of our (or Lightning's) training checkpoints: a sharded folder or a ``.ckpt`` file."""
    if path.is_dir():
        return (path / DCP_INDEX).exists() or (path / METADATA_FILENAME).exists()
    return path.is_file() and path.suffix == ".ckpt"


class InitialWeightsSetup(_Base):
    """Loading ``initial_weights`` for :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    initial_weights: Path | None
    _resumes: bool = False

    def check_initial_weights_before_launch(self, model: Module | None, trainer: Any, ckpt_path: Any) -> None:
        """The files found, and matched against ``model`` (whole, possibly on the meta device) when it exists; not
        when the entry point will restore a checkpoint (``ckpt_path``), whose weights replace them."""
        self._resumes = restores_a_checkpoint(trainer, ckpt_path)
        if self.initial_weights is None or self._resumes:
            return
        if is_training_checkpoint(self.initial_weights):
            validate_checkpoint(self.initial_weights, True)  # finished and undamaged; its keys are checked at load
            return
        read_pretrained_files(self.initial_weights)
        if model is not None:
            check_pretrained_fit(model, self.initial_weights)

    def load_initial_weights(self) -> None:
        """At setup, after parallelizing and materializing: every rank loads its slices of ``initial_weights``."""
        if self.initial_weights is None:
            return
        if self._resumes:
            self.log_decision(f"initial_weights={str(self.initial_weights)!r} not read: resuming from ckpt_path")
            return
        assert self.model is not None
        if is_training_checkpoint(self.initial_weights):
            start = time.perf_counter()
            load_checkpoint_into(self.initial_weights, self.model, [], True, self.stage_layout, weights_only=True)
            self.log_decision(
                f"initial_weights: the model weights of the checkpoint {str(self.initial_weights)!r} (no optimizer or"
                f" loop state), each rank reading its own slices, in {time.perf_counter() - start:.1f} s"
            )
            return
        aliases: dict[str, tuple[str, ...]] = {}
        for part in self.step_parts():  # pipeline: a weight tied across stages has a copy per stage
            aliases.update(part.weight_aliases())
        start = time.perf_counter()
        trainer = attached_trainer(self.lightning_module)  # none in a Fabric loop: progress shown on rank 0
        shown = self.global_rank == 0 and (
            trainer is None or getattr(trainer, "progress_bar_callback", None) is not None
        )
        threads = read_threads(self.num_processes)  # the node's cores shared by its ranks
        report = load_pretrained(self.model, self.initial_weights, aliases=aliases, progress=shown, threads=threads)
        where = f" into {report.prefix.rstrip('.')}" if report.prefix else ""
        stage = " (the first stage's)" if self.parallel_dims.pp > 1 else ""
        self.log_decision(
            f"initial_weights: {report.loaded} tensors{stage} of {str(report.path)!r} loaded{where}, each rank reading"
            f" only the slices it holds, in {time.perf_counter() - start:.1f} s"
        )
        adapters = _on_every_rank(report.adapters)
        if adapters:
            self.log_decision(adapters_kept_message(adapters))
        left = _on_every_rank(report.outside_prefix)
        if left:
            rank_zero_warn(left_at_init_message(str(report.path), report.prefix, left))


def _on_every_rank(names: tuple[str, ...]) -> list[str]:
    """The union of ``names`` over all ranks (a pipeline stage holds only its own state), sorted."""
    if not (dist.is_available() and dist.is_initialized()):
        return sorted(names)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(names))
    return sorted({name for part in gathered for name in part})


def adapters_kept_message(names: list[str]) -> str:
    """The log line for the LoRA adapters' own tensors, which no pretrained file holds."""
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"initial_weights: {len(names)} LoRA adapter tensors keep their own initialization (lora_B zero: training"
        f" starts from the pretrained model's outputs): {shown}"
    )


def left_at_init_message(path: str, prefix: str, names: list[str]) -> str:
    """The warning for the state ``initial_weights`` left at the model's own init (outside the pretrained prefix)."""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    where = f" (the pretrained model is at {prefix.rstrip('.')!r})" if prefix else ""
    return (
        f"initial_weights: {len(names)} parameters or buffers of the model are not in {path!r}{where} and keep their"
        f" own initialization: {shown}. That is right for a new head or adapter; if one of them is the pretrained"
        " model's own (a base model's weights given to a module with a language-model head), it trains from random"
        " values: give the folder of the model with its head."
    )
