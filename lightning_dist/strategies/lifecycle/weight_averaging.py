"""Lightning's weight-averaging callbacks under a lightning_dist strategy (a mixin of the shared base):
``WeightAveraging`` (EMA with ``get_ema_multi_avg_fn``, ``EMAWeightAveraging``, any ``avg_fn``) and
``StochasticWeightAveraging``.

Both callbacks deep-copy the LightningModule in their ``setup``, before the strategy parallelizes it, and copy values
between that copy and the model tensor by tensor, which fails once the model is sharded (and under a pipeline, whose
stages hold part of the model). After parallelizing, the strategy replaces each callback's copy with a
:func:`~lightning_dist.parallel.averaged_copy.sharded_copy` of the parallelized model (for ``WeightAveraging``
inside a :class:`~lightning_dist.parallel.averaged_copy.ShardedAveragedModel` that keeps its averaging function and
count). The callbacks then run unchanged, shard against shard, and each rank holds the average of what it holds.

Checkpoints are what Lightning writes in one process: ``WeightAveraging`` saves the averaged weights as
``state_dict`` and the model's own as ``current_model_state``, ``StochasticWeightAveraging`` its copy in its callback
state. Saves write these like the model's state (DCP shards, or gathered onto rank 0 by ``FullStateCheckpointIO``);
loads fill the model and the copies from them, and hand the callbacks the live states, so that their
``on_load_checkpoint``/``load_state_dict`` (which copy those values into the model and their copy) keep them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from torch.optim.swa_utils import AveragedModel
from typing_extensions import override

from lightning_dist.checkpoint.state_paths import (
    CURRENT_MODEL_STATE,
    MODEL_STATE,
    StatePath,
    callback_state_path,
    get_path,
    set_path,
)
from lightning_dist.compat.lightning import (
    attached_trainer,
    averaged_copy,
    averaging_device,
    clear_schedulers_for_swa,
    set_averaged_copy,
    set_averaging_device,
)
from lightning_dist.parallel.averaged_copy import ShardedAveragedModel, ShardedCopy, sharded_copy
from lightning_dist.parallel.fsdp import is_fully_sharded
from lightning_dist.parallel.materialize import has_meta_state
from lightning_dist.profiling import state_bytes
from lightning_dist.strategies.lifecycle.preflight import PARALLELIZED

_META = torch.device("meta")

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object


class WeightAveragingSetup(_Base):
    """Weight averaging of :class:`~lightning_dist.strategies.base.MeshParallelStrategy` (see the module docstring)."""

    #: The devices given to the ``WeightAveraging`` callbacks whose copy is made on meta, by callback id.
    _averaging_devices: dict[int, Any]

    def check_averaging_callbacks(self, trainer: pl.Trainer) -> None:
        """Before launch: refuse a weight-averaging callback that would deep-copy a model an earlier Trainer already
        sharded with FSDP2 (``WeightAveraging`` copies when ``fit`` starts, ``StochasticWeightAveraging`` at every
        entry point); FSDP2 modules cannot be deep-copied, and the callback's ``setup`` would fail on every rank."""
        model = self.lightning_module
        if model is None or getattr(model, PARALLELIZED, None) is None or not is_fully_sharded(model):
            return
        stage = trainer.state.fn.value if trainer.state.fn is not None else "fit"
        for callback in averaging_callbacks(trainer):
            if isinstance(callback, StochasticWeightAveraging) or stage == TrainerFn.FITTING.value:
                raise RuntimeError(_sharded_copy_refusal(type(callback).__name__, type(model).__name__, stage))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._copy_meta_models_on_meta()

    def _copy_meta_models_on_meta(self) -> None:
        """``WeightAveraging.setup`` (next, before the strategy materializes the model) moves its copy of the model to
        a device; a model created with ``Trainer.init_module(empty_init=True)`` is still on the meta device then,
        from where nothing can be copied. The callback's copy stays on meta instead (it costs nothing, and is
        replaced at setup); the device it was given is kept for the copy that replaces it."""
        module = self.lightning_module
        trainer = attached_trainer(module)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return  # WeightAveraging copies the model when fit starts only
        if not has_meta_state(module):
            return
        for callback in averaging_callbacks(trainer):
            if isinstance(callback, WeightAveraging) and averaging_device(callback) != _META:
                self._averaging_devices[id(callback)] = averaging_device(callback)
                set_averaging_device(callback, _META)

    def shard_averaged_copies(self, trainer: pl.Trainer) -> None:
        """Replace the averaged copy of each weight-averaging callback with one of the parallelized model (at setup,
        after parallelizing). Copies already made from it (fit, then test on one Trainer) are kept."""
        assert self.model is not None
        for callback in averaging_callbacks(trainer):
            if id(callback) in self._averaging_devices:  # copied on meta (see setup_environment)
                set_averaging_device(callback, self._averaging_devices.pop(id(callback)))
            copy = averaged_copy(callback)
            if isinstance(callback, WeightAveraging):
                if not isinstance(copy, AveragedModel) or isinstance(copy, ShardedAveragedModel):
                    continue
                device = averaging_device(callback)
                new: Module = ShardedAveragedModel.replacing(copy, sharded_copy(self.model, device))
                module = new.module
            elif copy is None or isinstance(copy, ShardedCopy):
                continue
            else:
                new = module = sharded_copy(self.model)
            set_averaged_copy(callback, new)
            self.log_decision(
                f"{type(callback).__name__}'s averaged copy made from the parallelized model:"
                f" {_size(state_bytes(module)['total'])} on this rank (the same tensors unsharded:"
                f" {_size(_unsharded_bytes(module))})"
            )

    def sharded_parameters_at_validation_end(self) -> bool:
        # WeightAveraging swaps its averaged weights into the model around validation; at the end of the loop FSDP2's
        # root (reshard_after_forward=False) would still hold gathered, unsharded parameters.
        return any(isinstance(averaged_copy(c), ShardedAveragedModel) for c in self._averaging_callbacks())

    def averaged_states_into(self, checkpoint: dict[str, Any], state_of: Callable[[Module], dict[str, Any]]) -> None:
        """Put the averaged copies' states into ``checkpoint`` where the callbacks did, as ``state_of`` gives a
        model's state (sharded, or in full on rank 0). Collective."""
        for callback in self._averaging_callbacks():
            copy = averaged_copy(callback)
            if isinstance(copy, ShardedAveragedModel) and CURRENT_MODEL_STATE[0] in checkpoint:
                checkpoint[MODEL_STATE[0]] = state_of(copy.module)  # WeightAveraging moved the model's own aside
            elif isinstance(copy, ShardedCopy):
                path = callback_state_path(callback.state_key)
                if isinstance(get_path(checkpoint, path), dict):
                    set_path(checkpoint, path, state_of(copy))

    def model_state_targets(self, saved: list[StatePath]) -> dict[StatePath, Module]:
        """Which module loads which of the ``saved`` model states: as Lightning's callbacks load them in one process
        (the model takes ``current_model_state`` where ``WeightAveraging`` saved one and is active, else
        ``state_dict``)."""
        assert self.model is not None
        targets: dict[StatePath, Module] = {MODEL_STATE: self.model}
        for callback in self._averaging_callbacks():
            copy = averaged_copy(callback)
            if isinstance(copy, ShardedAveragedModel) and CURRENT_MODEL_STATE in saved:
                targets[CURRENT_MODEL_STATE] = self.model
                targets[MODEL_STATE] = copy.module
            elif isinstance(copy, ShardedCopy) and callback_state_path(callback.state_key) in saved:
                targets[callback_state_path(callback.state_key)] = copy
        return targets

    def with_live_states(self, metadata: dict[str, Any], targets: dict[StatePath, Module]) -> dict[str, Any]:
        """``metadata`` (a loaded checkpoint without its model states) with the loaded modules' own states where the
        checkpoint held them, when a weight-averaging callback will read them: copying those into the model and its
        copy changes nothing, as in one process after loading."""
        if not any(
            isinstance(averaged_copy(c), (ShardedAveragedModel, ShardedCopy)) for c in self._averaging_callbacks()
        ):
            return metadata
        for path, module in targets.items():
            set_path(metadata, path, module.state_dict())
        return metadata

    def hand_over_swa_schedulers(self, metadata: dict[str, Any]) -> None:
        """``StochasticWeightAveraging`` drops the Trainer's schedulers in ``on_fit_start`` when its restored state
        holds an ``SWALR`` state (else the checkpoint's ``SWALR`` state would be loaded into the module's scheduler).
        A strategy that restores after setup, as ours do, restores callbacks after ``on_fit_start``: the strategy
        does it then, once the checkpoint is read, before Lightning restores the schedulers."""
        trainer = attached_trainer(self.lightning_module)
        if trainer is None or trainer.state.fn != TrainerFn.FITTING or not trainer.lr_scheduler_configs:
            return
        for callback in self._averaging_callbacks():
            state = get_path(metadata, ("callbacks", callback.state_key))
            if isinstance(callback, StochasticWeightAveraging) and isinstance(state, dict) and state["scheduler_state"]:
                clear_schedulers_for_swa(trainer)
                return

    def _averaging_callbacks(self) -> list[Callback]:
        trainer = attached_trainer(self.lightning_module)
        return averaging_callbacks(trainer) if trainer is not None else []


def _sharded_copy_refusal(callback: str, model: str, stage: str) -> str:
    what = (
        f"{callback} copies the LightningModule (copy.deepcopy) in its setup() when {stage} starts, and {model} was"
        " sharded with FSDP2 by an earlier Trainer: FSDP2 modules cannot be deep-copied."
    )
    if stage == TrainerFn.FITTING.value:
        return (
            f"{what} Fit a fresh, unsharded instance of the model (construct it again, or load one with"
            " `load_from_checkpoint`), or continue the earlier run with `ckpt_path`."
        )
    return (
        f"{what} The callback put its averaged weights into the model when its last epoch ended: {stage} without it"
        f" (a Trainer without {callback}, or `trainer.callbacks.remove(...)` first), or {stage} a model loaded"
        " with `load_from_checkpoint`."
    )


def averaging_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The Trainer's ``WeightAveraging`` and ``StochasticWeightAveraging`` callbacks."""
    return [c for c in trainer.callbacks if isinstance(c, (WeightAveraging, StochasticWeightAveraging))]


def _unsharded_bytes(module: Module) -> int:
    """The bytes of ``module``'s parameters and buffers at their global sizes (a DTensor's ``numel`` is global)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
