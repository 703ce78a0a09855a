"""The model tensors of any of our checkpoints, read a few at a time: a sharded DCP folder loads only the tensors
asked for (DCP's ``load`` with a state dict of just those keys, no process group), a single file is memory-mapped."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.integrity import verify_checksums
from lightning_dist.checkpoint.layout import PROVENANCE_KEY, is_sharded_checkpoint, read_checkpoint_file, read_metadata
from lightning_dist.checkpoint.safe_load import dcp_load_planner, dcp_reader, read_dcp_index, shard_error
from lightning_dist.checkpoint.validation import validate_checkpoint

_STATE = "state_dict"


class TensorSource(Protocol):
    """What an export reads tensors from: a checkpoint, or a view of one (merged adapters, another dtype)."""

    path: Path
    specs: dict[str, tuple[torch.Size, torch.dtype]]

    @property
    def provenance(self) -> dict[str, Any]: ...

    def nbytes(self, name: str) -> int: ...

    def read(self, names: list[str]) -> dict[str, torch.Tensor]: ...


class CheckpointTensors:
    """The ``state_dict`` of the checkpoint at ``path``: names, shapes and dtypes known up front, values read on
    demand by :meth:`read`. ``weights_only=False`` trusts the files with full unpickling."""

    def __init__(self, path: str | os.PathLike, weights_only: bool = True) -> None:
        self.path = validate_checkpoint(path, weights_only)
        self.weights_only = weights_only
        verify_checksums(self.path, weights_only, alone=True)  # exports run in one process, maybe one rank of a job
        self.sharded = is_sharded_checkpoint(self.path)
        if self.sharded:
            self.metadata = read_metadata(self.path, weights_only)
            index = read_dcp_index(self.path) if weights_only else None
            items = (index or _trusted_index(self.path)).state_dict_metadata
            self.specs = {
                fqn[len(_STATE) + 1 :]: (torch.Size(meta.size), meta.properties.dtype)
                for fqn, meta in items.items()
                if fqn.startswith(f"{_STATE}.") and isinstance(meta, TensorStorageMetadata)
            }
        else:
            checkpoint = self._mapped_file()
            self.metadata = {k: v for k, v in checkpoint.items() if k not in (_STATE, "optimizer_states")}
            self.specs = {k: (v.shape, v.dtype) for k, v in checkpoint[_STATE].items() if torch.is_tensor(v)}
        if not self.specs:
            raise CheckpointError(f"The checkpoint {str(self.path)!r} holds no model tensors in its 'state_dict'.")

    @property
    def provenance(self) -> dict[str, Any]:
        entry = self.metadata.get(PROVENANCE_KEY)
        return entry if isinstance(entry, dict) else {}

    def nbytes(self, name: str) -> int:
        shape, dtype = self.specs[name]
        return math.prod(shape) * dtype.itemsize

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The full values of ``names``, in memory (a copy of the file's bytes), and nothing else."""
        if not self.sharded:  # mapped again for each read: the pages read before leave this process with the mapping
            state = self._mapped_file()[_STATE]
            return {name: state[name].clone() for name in names}
        state = {name: torch.empty(self.specs[name][0], dtype=self.specs[name][1]) for name in names}
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # no_dist is meant
                dcp.load(
                    {_STATE: state},
                    storage_reader=dcp_reader(self.path, self.weights_only),
                    planner=dcp_load_planner(self.weights_only),
                    no_dist=True,
                )
        except (Exception, dcp.CheckpointException) as err:  # DCP's CheckpointException is a BaseException
            raise shard_error(err, f"Could not read the shards of {str(self.path)!r}") from err
        return state

    def _mapped_file(self) -> dict[str, Any]:
        """The single-file checkpoint, its tensors memory-mapped (on disk until read)."""
        return read_checkpoint_file(self.path, self.weights_only, mmap=True)


def _trusted_index(path: Path) -> Any:
    return dcp_reader(path, weights_only=False).read_metadata()
