"""BatchNorm statistics over the ranks that split a batch: ``torch.nn.SyncBatchNorm`` on a chosen process group.

The group is the ranks that hold the same layers and different parts of the batch: data-parallel ranks, and
context-parallel ranks (each holds part of every sequence). Not tensor-parallel peers, which hold the same samples,
nor other pipeline stages, which hold other layers and would never join the collective.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn


def sync_batch_norms(model: nn.Module, group: dist.ProcessGroup) -> tuple[nn.Module, int]:
    """``model`` with every BatchNorm layer a ``SyncBatchNorm`` over ``group`` (the same module unless ``model`` is
    itself a BatchNorm layer), and how many were converted."""
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group=group)
    return synced, sum(isinstance(m, nn.SyncBatchNorm) for m in synced.modules())
