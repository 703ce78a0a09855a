"""``Trainer(sync_batchnorm=True)`` under the mesh strategies.

Lightning hands its layer-sync plugin (``TorchSyncBatchNorm``, or a ``LayerSync`` of the user's) to every parallel
strategy, but only its DDP and FSDP strategies apply it: under the mesh strategies the flag did nothing, and BatchNorm
normalized over each rank's part of the batch, unlike one process. It is applied when a fit starts, before the model
is parallelized: ``TorchSyncBatchNorm`` over the strategy's loss group (data × context parallel, see
:mod:`lightning_dist.parallel.batch_norm_sync`), another plugin with its own ``apply``. It stays after the fit (in eval
mode SyncBatchNorm normalizes with its running statistics, as BatchNorm does): the sharded modules cannot be swapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.plugins import TorchSyncBatchNorm
from lightning.pytorch.trainer.states import TrainerFn

from lightning_dist.compat.lightning import layer_sync
from lightning_dist.parallel.batch_norm_sync import sync_batch_norms

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_dist.strategies.base import MeshParallelStrategy


def apply_layer_sync(strategy: MeshParallelStrategy, trainer: pl.Trainer) -> None:
    """Apply the Trainer's layer sync to ``strategy.model`` when a fit starts (called before parallelizing)."""
    plugin = layer_sync(strategy)
    if plugin is None or trainer.state.fn != TrainerFn.FITTING or strategy.model is None:
        return
    if not isinstance(plugin, TorchSyncBatchNorm):
        strategy.model = plugin.apply(strategy.model)
        strategy.log_decision(f"layer sync: {type(plugin).__name__}.apply")
        return
    group = strategy.process_group("loss")
    strategy.model, count = sync_batch_norms(strategy.model, group)
    size = group.size() if group is not None else 1
    strategy.log_decision(f"sync_batchnorm: {count} BatchNorm layer(s) synced over the loss group ({size} ranks)")
