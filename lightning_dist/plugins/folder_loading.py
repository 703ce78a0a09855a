"""Lightning's own checkpoint loading reads lightning_dist's sharded checkpoint folders.

``MyModule.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)`` in a notebook after a sharded run, or a
resume under Lightning's ``strategy="auto"``/``"ddp"`` (``TorchCheckpointIO``), passed the folder to ``torch.load``,
which failed with ``IsADirectoryError``. A local folder is now read as one Lightning checkpoint (full tensors,
position-keyed optimizer states: :func:`~lightning_dist.checkpoint.consolidate.load_full_checkpoint`, which verifies
it first and needs no process group); anything else goes to Lightning's loader unchanged. Weights-only unpickling
unless the caller passes ``weights_only=False``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_dist.checkpoint.consolidate import load_full_checkpoint
from lightning_dist.compat.lightning import route_checkpoint_loading


def read_folders_too(lightning_load: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's ``pl_load`` that also reads a sharded checkpoint folder."""

    @functools.wraps(lightning_load)
    def load(path_or_url: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
        if not _local_folder(path_or_url):
            return lightning_load(path_or_url, map_location=map_location, weights_only=weights_only)
        checkpoint = load_full_checkpoint(path_or_url, weights_only=weights_only is not False)
        if isinstance(map_location, (str, torch.device)):  # the tensors were read onto the CPU
            checkpoint = move_data_to_device(checkpoint, torch.device(map_location))
        return checkpoint

    return load


def register_folder_loading() -> None:
    """Route Lightning's loaders through :func:`read_folders_too` (on ``import lightning_dist``)."""
    route_checkpoint_loading(read_folders_too)


def _local_folder(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and "://" not in str(path) and os.path.isdir(path)
