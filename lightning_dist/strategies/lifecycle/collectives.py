"""Collectives of a lightning_dist strategy over the right group of its mesh (a mixin of the shared base).

Lightning reduces logged values and gathers tensors through the strategy. Over WORLD, ranks that saw the same data
(tensor, context and pipeline peers) would count twice, and a pipeline's stages other than the last hold no loss:
the defaults here reduce over the ``loss`` group and take a pipeline's values from its loss stage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies.strategy import TBroadcast
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_dist.compat.lightning import all_reduce_if_distributed


class MeshCollectives:
    """``reduce``/``all_gather``/``broadcast``/``barrier`` of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    def process_group(self, name: str = "loss") -> dist.ProcessGroup:
        """The process group of a mesh axis or derived group (``"batch"``, ``"fsdp"``, ``"loss"``, ``"tp"``...)."""
        return self.mesh[name].get_group()

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold different samples (``dp_replicate × dp_shard``; ``None`` before the mesh exists).

        ``self.log(name, value, reduce_fx="sum", sync_dist=True, sync_dist_group=trainer.strategy.data_parallel_group)``
        sums a per-sample value once per sample, where the default group (data-parallel × context-parallel ranks)
        would count it once per context-parallel rank."""
        return self.process_group("batch") if self._mesh is not None else None

    @override
    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not dist.is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce over ``group``; by default over the ``loss`` group, so TP/PP peers are not counted twice, after
        taking the loss stage's value on a pipeline mesh.

        A DTensor (``self.log("w", param.norm(), sync_dist=True)`` on a sharded parameter) is first made whole, so the
        value is the one DDP logs.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if group is None and self._mesh is not None:
            dims = self.parallel_dims
            if dims.pp > 1:
                tensor = self.from_loss_stage(tensor)
            if dims.batch * dims.cp == 1:
                return tensor  # a one-rank loss group (tensor/pipeline peers only): every rank holds the value now
            group = self.process_group("loss")
        return all_reduce_if_distributed(tensor, group, reduce_op=reduce_op)

    @property
    def loss_stage(self) -> int:
        """The pipeline stage whose ranks hold the true loss and logged values (the last); the others' are
        placeholders, replaced by :meth:`reduce` with the loss stage's before they are averaged."""
        return self.parallel_dims.pp - 1

    def from_loss_stage(self, tensor: Tensor) -> Tensor:
        """The loss stage's value of ``tensor`` on every pipeline stage (a broadcast over ``pp``)."""
        value = tensor.detach().clone().contiguous()
        dist.broadcast(value, group=self.process_group("pp"), group_src=self.loss_stage)
        return value

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Gather over ``group``; by default over the ``loss`` group (one value per data-parallel replica). DTensors
        are gathered by their full values."""
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if group is None and self._mesh is not None:
            group = self.process_group("loss")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Every rank of the job takes the same decision (early stopping, checkpointing): reduce over all ranks."""
        if not dist.is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = all_reduce_if_distributed(flag, dist.group.WORLD, reduce_op=ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)
