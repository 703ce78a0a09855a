"""Checks that run before any process is launched.

A mistake found after ``devices=N`` processes started costs a launch per rank and, worse, can leave ranks waiting for
one that failed. Whatever can be known from the Trainer, the model and the arguments of ``fit``/``validate``/
``test``/``predict`` is therefore checked in the launching process, before the other ranks exist. When torchrun or
SLURM created the processes, every rank runs the same checks on the same inputs, so all of them fail with the same
message and none waits for the others.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_dist.checkpoint.safe_load import resolve_weights_only
from lightning_dist.checkpoint.validation import validate_checkpoint
from lightning_dist.compat.lightning import LauncherBase, SignalNumber, SubprocessScriptLauncherBase
from lightning_dist.parallel.runtime.random_state import rng_kept
from lightning_dist.strategies.lifecycle.parallelize_options import PARALLELIZE_OPTIONS

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.strategies.base import MeshParallelStrategy

# Values of ``ckpt_path`` that Lightning resolves itself ("last", "best", ...) rather than paths on disk.
_NAMED_CHECKPOINTS = ("last", "best", "hpc", "registry")


# Set on a model once parallelized: the strategy settings that did it (see parallel_settings).
PARALLELIZED = "_lightning_dist_parallelized"
# Set (True) on an exception the checks before launch raised: bad input, which the console script prints as one line.
FOUND_BEFORE_LAUNCH = "lightning_dist_found_before_launch"


def run_preflight(strategy: MeshParallelStrategy, trainer: pl.Trainer, arguments: dict[str, Any]) -> None:
    """The strategy's checks before launch; what they raise is marked :data:`FOUND_BEFORE_LAUNCH`."""
    try:
        with rng_kept():  # the checks draw nothing from the stream the training will use
            strategy.preflight(trainer, arguments)
    except Exception as error:
        setattr(error, FOUND_BEFORE_LAUNCH, True)
        raise


def parallel_settings(strategy: MeshParallelStrategy) -> dict[str, str]:
    """What determines how ``strategy`` parallelizes a model: its class, mesh, precision and own options.

    Recorded on the model when it is parallelized; a later Trainer may reuse the model only with equal settings.
    """
    settings = {
        "strategy": type(strategy).__name__,
        "mesh": str(strategy.parallel_dims),
        "precision": str(strategy.precision_plugin.precision),
    }
    for name in [*strategy_options(type(strategy), include_base=False), *PARALLELIZE_OPTIONS]:
        if name not in settings:  # hybrid3d's `mesh` option: in "mesh" already (its attribute is the DeviceMesh)
            settings[name] = repr(getattr(strategy, name, None))
    return settings


def strategy_options(cls: type, include_base: bool = True) -> list[str]:
    """The constructor options of a strategy class: its own, its parents', and (``include_base``) the base's, which
    are Lightning's."""
    options: list[str] = []
    for klass in cls.__mro__:
        if klass.__name__ == "MeshParallelStrategy" and not include_base:
            break
        if "__init__" in vars(klass):
            for name, parameter in inspect.signature(klass.__init__).parameters.items():
                if name != "self" and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                    options.append(name)
        if klass.__name__ == "MeshParallelStrategy":
            break
    return list(dict.fromkeys(options))


def unknown_options_message(cls: type, unknown: dict[str, Any]) -> str:
    """Name each option ``cls`` does not have, with the closest one it does have, and list them all."""
    options = strategy_options(cls)
    parts = []
    for name in unknown:
        # expert_parallel_size is explained below; the closest name (data_parallel_size) would only mislead
        close = difflib.get_close_matches(name, options, n=1) if name != "expert_parallel_size" else []
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    hint = ""
    if "expert_parallel_size" in unknown:
        hint = (
            " Expert parallelism (expert_parallel_size) is carried by fsdp2 (and the expert_parallel strategy name)"
            f" and hybrid3d only; {cls.__name__} cannot split experts over ranks. Use strategy='expert_parallel', or"
            " Hybrid3DStrategy(expert_parallel_size=..., ...) with this strategy's axis, or drop expert_parallel_size."
        )
    if "fault_tolerance" in unknown:
        hint += (
            f" Fault tolerance (fault_tolerance) replicates the model across replica groups and is carried by fsdp2,"
            f" zeropp and hybrid3d only; {cls.__name__} has no data-parallel replicate axis to make fault tolerant."
            " Use Hybrid3DStrategy(fault_tolerance=..., ...) with this strategy's sizes (each group then holds one"
            " whole copy of the model), or FSDP2Strategy."
        )
    return f"{cls.__name__} has no option {', '.join(parts)}. Its options are: {', '.join(options)}.{hint}"


def check_same_parallelism(strategy: MeshParallelStrategy, applied: dict[str, str]) -> None:
    """Refuse a model that an earlier Trainer parallelized differently: its parameters are already sharded, and
    applying other parallelism on top would train on the old layout (or fail deep inside torch)."""
    wanted = parallel_settings(strategy)
    if applied == wanted:
        return
    differences = ", ".join(
        f"{key}: {applied.get(key, '-')} → {wanted.get(key, '-')}"
        for key in dict.fromkeys([*applied, *wanted])
        if applied.get(key) != wanted.get(key)
    )
    raise RuntimeError(
        f"{type(strategy.lightning_module).__name__} was already parallelized by an earlier Trainer with"
        f" {applied['strategy']} ({differences}). A sharded model cannot be parallelized again. Give this Trainer a"
        " fresh, unsharded instance of the model (construct it again, or load one with"
        " `load_from_checkpoint` from a checkpoint the first Trainer saved), or use the first Trainer's strategy"
        " settings."
    )


def check_ckpt_path(ckpt_path: Any, weights_only: bool | None = None) -> None:
    """Raise :class:`~lightning_dist.CheckpointError` if a local ``ckpt_path`` is missing, unfinished, or has a DCP
    index that needs more than DCP's metadata types (unless ``weights_only=False`` trusts it).

    Named checkpoints (``"last"``, ``"best"``...) and remote URLs (``s3://...``) are left to Lightning.
    """
    if ckpt_path is None:
        return
    text = str(ckpt_path)
    if text in _NAMED_CHECKPOINTS or text.startswith("registry:") or "://" in text:
        return
    validate_checkpoint(Path(text), resolve_weights_only(weights_only))


def check_callbacks(trainer: pl.Trainer) -> None:
    """Refuse the callbacks that cannot work under the strategy, naming what works instead."""
    check_checkpoint_callbacks(trainer)
    check_pruning_callbacks(trainer)


def check_pruning_callbacks(trainer: pl.Trainer) -> None:
    """Refuse Lightning's ``ModelPruning``: ``torch.nn.utils.prune`` ranks whole weight tensors and moves each pruned
    weight to ``<name>_orig`` behind a forward hook, while the strategy holds the weights as shards it gathers for
    each forward (it failed at the first epoch's end with a DTensor error about redistributing a sharded dimension)."""
    from lightning.pytorch.callbacks import ModelPruning

    if any(isinstance(callback, ModelPruning) for callback in trainer.callbacks):
        name = type(trainer.strategy).__name__
        raise ValueError(
            f"ModelPruning cannot run under {name}: torch.nn.utils.prune ranks whole weight tensors and re-registers"
            f" each pruned weight as '<name>_orig' behind a forward hook, while {name} holds the weights as shards"
            " that it gathers for every forward. Prune in one process or under strategy='ddp', or prune the trained"
            " weights afterwards: `lightning-dist consolidate CHECKPOINT OUT.ckpt` writes them whole into one file."
        )


def check_checkpoint_callbacks(trainer: pl.Trainer) -> None:
    """Refuse ``ModelCheckpoint(save_last="link")`` with the async plugin: the link would point at a checkpoint still
    being written, and at nothing if that save fails."""
    from lightning_dist.plugins.async_checkpoint_io import AsyncDistributedCheckpointIO

    if not isinstance(trainer.strategy.checkpoint_io, AsyncDistributedCheckpointIO):
        return
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "save_last", None) == "link":
            raise ValueError(
                "ModelCheckpoint(save_last='link') cannot be combined with AsyncDistributedCheckpointIO: the link"
                " would point at a checkpoint that is still being written (and at nothing if that save fails)."
                " Use save_last=True, or the synchronous DistributedCheckpointIO."
            )


def bound_arguments(function: Callable, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a Trainer entry point (``_fit_impl``...) by name."""
    try:
        return dict(inspect.signature(function).bind(*args, **kwargs).arguments)
    except TypeError:
        return {}


class PreflightSubprocessLauncher(SubprocessScriptLauncherBase):
    """Lightning's launcher for ``devices=N`` (re-runs the script per rank), with the strategy's checks first."""

    def __init__(self, strategy: MeshParallelStrategy, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            run_preflight(self._strategy, trainer, bound_arguments(function, args, kwargs))
        return super().launch(function, *args, trainer=trainer, **kwargs)


class PreflightLauncher(LauncherBase):
    """For processes created outside Lightning (torchrun, SLURM, the ranks our own launcher started): runs the
    strategy's checks, then the entry point, in this process."""

    def __init__(self, strategy: MeshParallelStrategy) -> None:
        self._strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            run_preflight(self._strategy, trainer, bound_arguments(function, args, kwargs))
        return function(*args, **kwargs)

    @override
    def kill(self, signum: SignalNumber) -> None:
        pass  # this launcher started no process
