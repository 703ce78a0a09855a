"""torchmetrics synchronization over the data-parallel group instead of WORLD.

A ``Metric`` syncs its states over WORLD unless told otherwise, which counts tensor/pipeline/context peers (which saw
the same samples) more than once in sum states. Storing a ProcessGroup on the metric would make the LightningModule
impossible to deep-copy or pickle (callbacks such as SWA deep-copy it), so the metric gets :func:`gather_over_data_parallel`
as its ``dist_sync_fn`` — a plain function that looks the group up when it runs.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

_GROUP: dist.ProcessGroup | None = None


def use_metric_group(group: dist.ProcessGroup | None) -> None:
    """Set the group :func:`gather_over_data_parallel` gathers over (``None``: WORLD)."""
    global _GROUP
    _GROUP = group


def gather_over_data_parallel(result: Tensor, group: Any | None = None) -> list[Tensor]:
    """torchmetrics' ``gather_all_tensors`` over ``group`` if given, else over the group set by the strategy."""
    from torchmetrics.utilities.distributed import gather_all_tensors

    return gather_all_tensors(result, group=group if group is not None else _GROUP)
