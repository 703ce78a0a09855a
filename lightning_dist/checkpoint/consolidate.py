"""Reading any lightning_dist checkpoint as one ordinary Lightning checkpoint dict, in one process, and writing it
out as one file (``torch.save`` or safetensors) for export."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

from lightning_dist.checkpoint.integrity import crc32_enabled, verify_checksums
from lightning_dist.checkpoint.layout import (
    PROVENANCE_KEY,
    CheckpointError,
    check_replaceable,
    foreign_content,
    is_sharded_checkpoint,
    new_token,
    publish,
    read_checkpoint_file,
    read_metadata,
    temporary_path,
    validate_checkpoint,
    with_provenance,
)
from lightning_dist.checkpoint.optimizer_format import is_name_keyed, names_to_positions
from lightning_dist.checkpoint.safe_load import RestrictedBytesLoading, dcp_reader, shard_error
from lightning_dist.checkpoint.state_paths import get_path, saved_state_paths, set_path
from lightning_dist.compat import load_dcp_without_process_group

#: Key of the safetensors header metadata that marks our exports (so a later export may replace them).
SAFETENSORS_MARKER = "lightning_dist"
#: Keys a weights-only export keeps: enough for ``LightningModule.load_from_checkpoint``.
WEIGHTS_ONLY_KEYS = ("state_dict", "hyper_parameters", "hparams_name", "pytorch-lightning_version", "lightning_dist")


def load_full_checkpoint(path: str | os.PathLike, weights_only: bool = True) -> dict[str, Any]:
    """The checkpoint at ``path`` as one dict in the format of a one-device Lightning checkpoint (full tensors,
    position-keyed ``optimizer_states``), whether it is a sharded folder or a single file, after verifying its
    checksums. Needs no process group. ``weights_only=False`` trusts the files with full unpickling."""
    path = validate_checkpoint(path, weights_only)
    verify_checksums(path, weights_only)
    if not is_sharded_checkpoint(path):
        return read_checkpoint_file(path, weights_only, mmap=False)
    checkpoint = read_metadata(path, weights_only)
    try:
        restricted = RestrictedBytesLoading if weights_only else None
        sharded = load_dcp_without_process_group(dcp_reader(path, weights_only), restricted)
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise shard_error(err, f"Could not read the shards of {str(path)!r}") from err
    if not isinstance(sharded.get("state_dict"), dict):
        raise CheckpointError(f"The checkpoint {str(path)!r} holds no 'state_dict' of model weights in its shards.")
    for state_path in saved_state_paths(checkpoint.get(PROVENANCE_KEY, {})):  # weight averaging's, state_dict's
        set_path(checkpoint, state_path, get_path(sharded, state_path))
    optimizers = sorted((k for k in sharded if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_position_keyed(sharded[k]) for k in optimizers]
    return checkpoint


def weights_only(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Drop optimizer, loop and callback states; what remains loads with ``load_from_checkpoint``."""
    return {k: v for k, v in checkpoint.items() if k in WEIGHTS_ONLY_KEYS}


def save_torch(checkpoint: dict[str, Any], out: str | os.PathLike) -> Path:
    """``torch.save`` ``checkpoint`` to ``out`` atomically (temporary file, then rename). ``out`` may replace only an
    earlier export or checkpoint of ours (:func:`~lightning_dist.checkpoint.layout.check_replaceable`)."""
    out = Path(out)
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out, new_token())
    with crc32_enabled():
        torch.save(with_provenance(checkpoint), tmp)
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
    metadata[SAFETENSORS_MARKER] = "consolidated"
    out = Path(out)
    if (out.exists() or out.is_symlink()) and not is_own_safetensors(out):
        raise CheckpointError(
            f"Refusing to write {str(out)!r}: {foreign_content(out) or 'it is not a lightning_dist export'}."
            " Exports replace only an earlier safetensors export of lightning_dist. Choose another path."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(out, new_token())
    save_file(tensors, str(tmp), metadata=metadata)
    publish(tmp, out)
    return out


def is_own_safetensors(path: Path) -> bool:
    """Whether ``path`` is a safetensors file this module wrote (its header metadata carries our marker)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 100 * 2**20:
                return False
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return False
    return isinstance(header, dict) and (header.get("__metadata__") or {}).get(SAFETENSORS_MARKER) == "consolidated"


def _position_keyed(optimizer_state: dict[str, Any]) -> dict[str, Any]:
    return names_to_positions(optimizer_state) if is_name_keyed(optimizer_state) else optimizer_state
