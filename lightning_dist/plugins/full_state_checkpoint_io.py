"""A consolidated single-file checkpoint written by rank 0: a plain Lightning checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_dist.checkpoint.integrity import crc32_enabled
from lightning_dist.checkpoint.layout import check_replaceable, publish, temporary_path, with_provenance
from lightning_dist.checkpoint.recovery import prepare_target
from lightning_dist.checkpoint.save_failures import save_failure
from lightning_dist.compat.lightning import StrOrPath
from lightning_dist.plugins.checkpoint_io import ParallelCheckpointIO, on_rank_zero_then_check, shared_token


class FullStateCheckpointIO(ParallelCheckpointIO):
    """Gathers the full (unsharded) model and optimizer states to rank 0, which writes one ``torch.save`` file.

    The file is an ordinary Lightning checkpoint: ``torch.load`` reads it, ``MyModule.load_from_checkpoint(path)``
    restores the module in a one-process session, and a one-device ``Trainer`` resumes from it (optimizer states are
    keyed by parameter position, as ``Optimizer.state_dict`` does). lightning_dist strategies resume from it on any
    number of ranks. Costs: rank 0 holds the whole state in CPU memory while saving; for large models prefer the
    sharded :class:`~lightning_dist.plugins.DistributedCheckpointIO` and ``lightning-dist consolidate`` later.
    """

    full_state: ClassVar[bool] = True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: StrOrPath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options.")
        path = Path(path)
        tmp = temporary_path(path, shared_token())

        def write() -> None:
            check_replaceable(path)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                prepare_target(path)
                # A Python file, not a path: torch's own file writer reports a full disk as "unexpected pos", while
                # the OSError of a Python file's write stays in the chain of causes, with its errno.
                with crc32_enabled(), open(tmp, "wb") as file:  # crc32: what loads verify, for every zip record
                    torch.save(with_provenance(checkpoint), file)
                publish(tmp, path)
            except Exception as err:
                raise save_failure(path, err, tmp) from err

        on_rank_zero_then_check(write, f"write the checkpoint {path}")
