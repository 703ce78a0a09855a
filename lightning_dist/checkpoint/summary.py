"""What is in a checkpoint, read without loading its tensors (for a sharded one): ``lightning-dist inspect``."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_dist.checkpoint.export_target import EXPORT_ENTRY
from lightning_dist.checkpoint.integrity import verify_checksums
from lightning_dist.checkpoint.layout import is_sharded_checkpoint, read_checkpoint_file, read_metadata
from lightning_dist.checkpoint.safe_load import dcp_reader
from lightning_dist.checkpoint.validation import validate_checkpoint


@dataclass
class TensorEntry:
    key: str
    shape: list[int]
    dtype: str
    bytes: int


@dataclass
class CheckpointSummary:
    path: str
    format: str  # "sharded (DCP)" or "single file"
    epoch: int | None
    global_step: int | None
    saved_with: dict[str, Any]  # strategy, world size and mesh recorded by lightning_dist (empty if not ours)
    integrity: str  # what was checked: files, sizes, checksums
    tensors: list[TensorEntry] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors)

    @property
    def model_bytes(self) -> int:
        return sum(t.bytes for t in self.tensors if t.key.startswith("state_dict."))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes, "model_bytes": self.model_bytes}


def summarize_checkpoint(
    path: str | os.PathLike, checksums: bool = True, weights_only: bool = True
) -> CheckpointSummary:
    """Step, how it was saved, and every tensor's key, global shape, dtype and bytes, after checking that every file
    is there with its size and (``checksums``) its recorded checksum; a damaged checkpoint raises
    :class:`~lightning_dist.CheckpointError`. ``weights_only=False`` trusts the files with full unpickling."""
    path = validate_checkpoint(path, weights_only)
    integrity = (
        verify_checksums(path, weights_only).describe()
        if checksums
        else "integrity: files present; checksums not checked"
    )
    if is_sharded_checkpoint(path):
        meta = read_metadata(path, weights_only)
        index = dcp_reader(path, weights_only).read_metadata().state_dict_metadata
        tensors = [
            _entry(key, list(m.size), m.properties.dtype)
            for key, m in index.items()
            if isinstance(m, TensorStorageMetadata)
        ]
        fmt = "sharded (DCP)"
    else:
        meta = read_checkpoint_file(path, weights_only)
        states = {"state_dict": meta.get("state_dict", {})}
        for idx, optim_state in enumerate(meta.get("optimizer_states", [])):
            states[f"optimizer_{idx}"] = optim_state
        tensors = [_entry(key, list(t.shape), t.dtype) for key, t in _flatten(states) if torch.is_tensor(t)]
        fmt = "single file"
    return CheckpointSummary(
        path=str(path),
        format=fmt,
        epoch=meta.get("epoch"),
        global_step=meta.get("global_step"),
        saved_with=dict(meta.get("lightning_dist", {})),
        integrity=integrity,
        tensors=sorted(tensors, key=lambda t: (not t.key.startswith("state_dict."), t.key)),
    )


def format_summary(summary: CheckpointSummary, max_rows: int | None = None) -> str:
    """A human-readable report."""
    saved = summary.saved_with
    lines = [
        f"checkpoint: {summary.path}",
        f"format:     {summary.format}",
        f"epoch:      {summary.epoch}    global_step: {summary.global_step}",
    ]
    if saved.get("strategy") is not None:
        lines.append(
            f"saved with: {saved.get('strategy')} on {saved.get('world_size')} processes, mesh {saved.get('mesh')}"
        )
    else:
        lines.append("saved with: (not recorded: not written by a lightning_dist strategy)")
    if isinstance(export := saved.get(EXPORT_ENTRY), dict):
        lines.append(f"exported:   by lightning-dist {export.get('tool')} (a later export may replace this file)")
    lines.append(summary.integrity)
    rows = summary.tensors if max_rows is None else summary.tensors[:max_rows]
    width = max((len(t.key) for t in rows), default=3)
    lines.append("")
    lines.append(f"{'key':<{width}}  {'shape':<20} {'dtype':<10} {'bytes':>12}")
    for t in rows:
        lines.append(f"{t.key:<{width}}  {tuple(t.shape)!s:<20} {t.dtype:<10} {t.bytes:>12,}")
    if len(rows) < len(summary.tensors):
        lines.append(f"... {len(summary.tensors) - len(rows)} more (use --all)")
    n_model = sum(t.key.startswith("state_dict.") for t in summary.tensors)
    lines.append(
        f"{len(summary.tensors)} tensors, {summary.total_bytes:,} bytes"
        f" (model: {n_model} tensors, {summary.model_bytes:,} bytes; the rest is optimizer state)"
    )
    return "\n".join(lines)


def _entry(key: str, shape: list[int], dtype: torch.dtype) -> TensorEntry:
    numel = 1
    for s in shape:
        numel *= s
    return TensorEntry(key=key, shape=shape, dtype=str(dtype).removeprefix("torch."), bytes=numel * dtype.itemsize)


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [item for k, v in obj.items() for item in _flatten(v, f"{prefix}{k}.")]
    if isinstance(obj, (list, tuple)):
        return [item for i, v in enumerate(obj) for item in _flatten(v, f"{prefix}{i}.")]
    return [(prefix[:-1], obj)]
