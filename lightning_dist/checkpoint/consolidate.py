"""Reading any lightning_dist checkpoint as one ordinary Lightning checkpoint dict, in one process, and writing it
out as one file (``torch.save`` or safetensors) for export."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from lightning_dist.checkpoint.layout import (
    METADATA_FILENAME,
    CheckpointError,
    is_sharded_checkpoint,
    new_token,
    publish,
    temporary_path,
    validate_checkpoint,
)
from lightning_dist.checkpoint.optimizer_format import is_name_keyed, names_to_positions
from lightning_dist.compat import load_dcp_without_process_group

#: Keys a weights-only export keeps: enough for ``LightningModule.load_from_checkpoint``.
WEIGHTS_ONLY_KEYS = ("state_dict", "hyper_parameters", "hparams_name", "pytorch-lightning_version", "lightning_dist")


def load_full_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint at ``path`` as one dict in the format of a one-device Lightning checkpoint (full tensors,
    position-keyed ``optimizer_states``), whether it is a sharded folder or a single file. Needs no process group."""
    path = validate_checkpoint(path)
    if not is_sharded_checkpoint(path):
        return torch.load(path, map_location="cpu", weights_only=False)
    checkpoint = torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=False)
    try:
        sharded = load_dcp_without_process_group(path)
    except Exception as err:
        raise CheckpointError(f"Could not read the shards of {str(path)!r}: {err}") from err
    checkpoint["state_dict"] = sharded.pop("state_dict")
    optimizers = sorted((k for k in sharded if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_position_keyed(sharded[k]) for k in optimizers]
    return checkpoint


def weights_only(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Drop optimizer, loop and callback states; what remains loads with ``load_from_checkpoint``."""
    return {k: v for k, v in checkpoint.items() if k in WEIGHTS_ONLY_KEYS}


def save_torch(checkpoint: dict[str, Any], out: str | os.PathLike) -> Path:
    """``torch.save`` ``checkpoint`` to ``out`` atomically (temporary file, then rename)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out, new_token())
    torch.save(checkpoint, tmp)
    publish(tmp, out)
    return out


def save_safetensors(checkpoint: dict[str, Any], out: str | os.PathLike) -> Path:
    """Write the model weights (``state_dict``) as a safetensors file; scalars of the checkpoint go to its metadata."""
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError(
            "safetensors output needs the `safetensors` package: pip install 'lightning-dist[export]'"
        ) from err
    tensors = {k: v.detach().contiguous().clone() for k, v in checkpoint["state_dict"].items() if torch.is_tensor(v)}
    metadata = {k: str(checkpoint[k]) for k in ("epoch", "global_step", "pytorch-lightning_version") if k in checkpoint}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out, new_token())
    save_file(tensors, str(tmp), metadata=metadata)
    publish(tmp, out)
    return out


def _position_keyed(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    return names_to_positions(optimizer_state) if is_name_keyed(optimizer_state) else optimizer_state
