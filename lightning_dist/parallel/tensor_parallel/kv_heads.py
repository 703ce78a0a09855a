"""Grouped-query attention with fewer key/value heads than tensor-parallel ranks.

With ``kv_heads < tp`` (and ``tp`` a multiple of ``kv_heads``) the query heads are sharded as usual, and each key/value
head is replicated over the ``tp / kv_heads`` consecutive ranks whose query heads use it (as Megatron-style trainers
do). The key/value projections' parameters are replicated DTensors; each rank computes the whole projection and keeps
the columns of its head. Its output is declared a *partial* gradient, so the backward gives the projection a
``Partial`` gradient (each rank holds the contribution of its head only) and the input's gradient is summed over tp.
Summing the parameter gradient over tp adds, for every key/value head, the contributions of exactly the ranks that
share it (the others contributed zeros): the strategy's tp-replicated gradient reduction sums partial gradients.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


def kv_head_of_rank(rank: int, tp: int, kv_heads: int) -> int:
    """The key/value head rank ``rank`` computes (its query heads are ``heads/tp`` consecutive ones)."""
    return rank // (tp // kv_heads)


class ReplicatedKVHeadParallel(ParallelStyle):
    """A key or value projection (``nn.Linear``) replicated over tp; each rank's output is its own head's columns.

    Args:
        kv_heads: Key/value heads of the projection (fewer than tp, dividing it).
    """

    def __init__(self, kv_heads: int) -> None:
        super().__init__()
        self.kv_heads = kv_heads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        head = kv_head_of_rank(device_mesh.get_local_rank(), tp, self.kv_heads)
        width = module.out_features // self.kv_heads

        def partition(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dparam = distribute_tensor(param, mesh, [Replicate()], src_data_rank=self.src_data_rank)
                mod.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

        def inputs(_: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            elif x.placements != (Replicate(),):
                x = x.redistribute(placements=[Replicate()])
            return (x, *args[1:])

        def outputs(_: nn.Module, out: Tensor, mesh: DeviceMesh) -> Tensor:
            local = out.to_local(grad_placements=[Partial()])
            return local[..., head * width : (head + 1) * width]

        return distribute_module(module, device_mesh, partition, inputs, outputs)
