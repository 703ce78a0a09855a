"""Checks that run before any process is launched.

A mistake found after ``devices=N`` processes started costs a launch per rank and, worse, can leave ranks waiting for
one that failed. Whatever can be known from the Trainer, the model and the arguments of ``fit``/``validate``/
``test``/``predict`` is therefore checked in the launching process, before the other ranks exist. When torchrun or
SLURM created the processes, every rank runs the same checks on the same inputs, so all of them fail with the same
message and none waits for the others.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.trainer.connectors.signal_connector import _SIGNUM
from typing_extensions import override

from lightning_dist.checkpoint.layout import validate_checkpoint

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.strategies.base import MeshParallelStrategy

# Values of ``ckpt_path`` that Lightning resolves itself ("last", "best", ...) rather than paths on disk.
_NAMED_CHECKPOINTS = ("last", "best", "hpc", "registry")


def check_ckpt_path(ckpt_path: Any) -> None:
    """Raise :class:`~lightning_dist.CheckpointError` if a local ``ckpt_path`` is missing or unfinished.

    Named checkpoints (``"last"``, ``"best"``...) and remote URLs (``s3://...``) are left to Lightning.
    """
    if ckpt_path is None:
        return
    text = str(ckpt_path)
    if text in _NAMED_CHECKPOINTS or text.startswith("registry:") or "://" in text:
        return
    validate_checkpoint(Path(text))


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


class PreflightSubprocessLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher for ``devices=N`` (re-runs the script per rank), with the strategy's checks first."""

    def __init__(self, strategy: MeshParallelStrategy, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if trainer is not None:
            self._strategy.preflight(trainer, bound_arguments(function, args, kwargs))
        return super().launch(function, *args, trainer=trainer, **kwargs)


class PreflightLauncher(_Launcher):
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
            self._strategy.preflight(trainer, bound_arguments(function, args, kwargs))
        return function(*args, **kwargs)

    @override
    def kill(self, signum: _SIGNUM) -> None:
        pass  # this launcher started no process
