"""Tensor-parallel styles for projections torch's styles do not take: Hugging Face ``Conv1D`` and fused QKV.

- :class:`Conv1DParallel`: column- or row-wise sharding of GPT-2's ``Conv1D`` (weight stored ``(in, out)``).
- :class:`FusedColwiseParallel`: column-wise sharding of a fused query/key/value projection (``nn.Linear`` or
  ``Conv1D``) *by heads*: the rows are first put in rank order (:func:`~lightning_dist.parallel.fused_layouts.
  rank_grouped_order`), so each rank's contiguous shard holds its own heads of q, then k, then v, and the module's
  forward (told the per-rank head counts) splits its local output as it would the global one.
- :class:`FusedGateUpParallel`: column-wise sharding of a fused ``[gate | up]`` MLP projection (Phi-3's
  ``gate_up_proj``) so that each rank holds matching rows of gate and up: its local output chunks into its own gate
  and up halves, as the module's forward chunks the global one.

With fewer key/value heads than ranks, the ranks sharing a key/value head each hold a piece of its ``[k | v]`` rows
(so every row is still stored once and gradient norms need no correction); the pieces of the projection's output are
gathered over exactly those ranks in forward, and backward sums their gradients over the same ranks.

The permuted rows are an internal layout: :mod:`lightning_dist.parallel.tensor_parallel.checkpoint_layout` restores the original
order in state dicts and applies it again on load, so checkpoints keep the library's layout.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from lightning_dist.compat import apply_parallel_style
from lightning_dist.parallel.fused_layouts import FusedLayout, block_rank_order, rank_grouped_order
from lightning_dist.parallel.model_structure import is_conv1d
from lightning_dist.parallel.tensor_parallel.checkpoint_layout import record_row_order

Kind = Literal["colwise", "rowwise"]


class Conv1DParallel(ParallelStyle):
    """Column-wise (output features) or row-wise (input features) sharding of a Hugging Face ``Conv1D``.

    Inputs and outputs are plain tensors, as with torch's ``ColwiseParallel``/``RowwiseParallel``: column-wise takes
    the whole input and returns this rank's output features; row-wise takes this rank's input features and returns
    the summed, whole output (the bias added once).
    """

    def __init__(self, kind: Kind, input_layout: Placement | None = None, output_layout: Placement | None = None):
        super().__init__()
        self.kind = kind
        default_in, default_out = (Replicate(), Shard(-1)) if kind == "colwise" else (Shard(-1), Replicate())
        self.input_layout = input_layout or default_in
        self.output_layout = output_layout or default_out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not is_conv1d(module):
            raise TypeError(f"Conv1DParallel shards Hugging Face Conv1D modules, not {type(module).__name__}")
        placements = {"weight": Shard(1), "bias": Shard(0)} if self.kind == "colwise" else {"weight": Shard(0)}

        def partition(_: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                placement = placements.get(pname, Replicate())
                dparam = distribute_tensor(param, mesh, [placement], src_data_rank=self.src_data_rank)
                mod.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

        def inputs(_: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
            desired = Replicate() if self.kind == "colwise" else Shard(-1)
            if x.placements != (desired,):
                x = x.redistribute(placements=[desired])
            return (x, *args[1:])

        def outputs(_: nn.Module, out: Tensor, mesh: DeviceMesh) -> Tensor:
            if out.placements != (self.output_layout,):
                out = out.redistribute(placements=[self.output_layout])
            return out.to_local()

        return distribute_module(module, device_mesh, partition, inputs, outputs)


class FusedColwiseParallel(ParallelStyle):
    """Shard a fused query/key/value projection by heads over the tp ranks (see the module docstring).

    Args:
        layout: The row order of the projection's output.
        input_layout: Layout of the incoming activations (``Shard(1)`` under sequence parallel).
    """

    def __init__(self, layout: FusedLayout, input_layout: Placement | None = None) -> None:
        super().__init__()
        self.layout = layout
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp, layout = device_mesh.size(), self.layout
        order = rank_grouped_order(layout, tp)
        if order is not None:
            _permute_output_rows(module, order)
        if is_conv1d(module):
            module = Conv1DParallel("colwise", input_layout=self.input_layout)._apply(module, device_mesh)
        else:
            module = apply_parallel_style(ColwiseParallel(input_layouts=self.input_layout), module, device_mesh)
        if layout.num_kv_heads < tp:
            sharers = tp // layout.num_kv_heads
            group = _sharing_group(device_mesh, sharers)
            module.register_forward_hook(_KVPieceGather(layout.num_heads // tp * layout.head_dim, sharers, group))
        return module


class FusedGateUpParallel(ParallelStyle):
    """Shard a fused ``[gate | up]`` projection (``nn.Linear``) so each rank holds matching halves.

    Args:
        input_layout: Layout of the incoming activations (``Shard(1)`` under sequence parallel).
    """

    def __init__(self, input_layout: Placement | None = None) -> None:
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Linear or module.out_features % 2:
            raise TypeError(f"fused_gate_up shards an nn.Linear with an even number of outputs, not {module}")
        half = module.out_features // 2
        _permute_output_rows(module, block_rank_order((half, half), device_mesh.size()))
        return apply_parallel_style(ColwiseParallel(input_layouts=self.input_layout), module, device_mesh)


class _GatherPieces(torch.autograd.Function):
    """Forward: concatenate the group's pieces (last dim, in group order). Backward: sum the whole gradient over the
    group (every member used the gathered head) and return this rank's piece."""

    @staticmethod
    def forward(ctx: Any, piece: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group, ctx.index, ctx.width = group, dist.get_rank(group), piece.shape[-1]
        parts = [
            torch.empty_like(piece, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))
        ]
        dist.all_gather(parts, piece.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[..., ctx.index * ctx.width : (ctx.index + 1) * ctx.width].contiguous(), None


class _KVPieceGather:
    """Forward hook of a fused projection: ``[q | piece]`` → ``[q | k_g | v_g]``."""

    def __init__(self, q_width: int, sharers: int, group: dist.ProcessGroup) -> None:
        self.q_width, self.sharers, self.group = q_width, sharers, group

    def __call__(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        q, piece = out.split([self.q_width, out.shape[-1] - self.q_width], dim=-1)
        return torch.cat([q, _GatherPieces.apply(piece, self.group)], dim=-1)


def _sharing_group(mesh: DeviceMesh, sharers: int) -> dist.ProcessGroup:
    """The process group of this rank and the other ranks (consecutive on the tp mesh) sharing its key/value head;
    made once per mesh (kept on it: every layer reuses it), by its members only."""
    ranks = mesh.mesh.flatten().tolist()
    start = mesh.get_local_rank() // sharers * sharers
    members = tuple(ranks[start : start + sharers])
    groups: dict[tuple[int, ...], dist.ProcessGroup] = mesh.__dict__.setdefault("_lightning_dist_kv_groups", {})
    if members not in groups:
        groups[members] = dist.new_group(list(members), use_local_synchronization=True)
    return groups[members]


def _permute_output_rows(module: nn.Module, order: Tensor) -> None:
    """Put the output rows of ``module`` (weight and bias) in ``order``, recorded for the state-dict boundary."""
    dims = {"weight": 1 if is_conv1d(module) else 0, "bias": 0}
    with torch.no_grad():
        for pname, dim in dims.items():
            param = getattr(module, pname, None)
            if param is not None:
                permuted = param.index_select(dim, order.to(param.device))
                module.register_parameter(pname, nn.Parameter(permuted, requires_grad=param.requires_grad))
                record_row_order(module, pname, dim, order)


def fused_spec(layout: FusedLayout) -> dict[str, Any]:
    """The plan entry (plain data) of a fused projection with ``layout``."""
    return {
        "style": "fused_colwise",
        "order": layout.order,
        "heads": layout.num_heads,
        "kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
    }


def layout_from_spec(options: dict[str, Any]) -> FusedLayout:
    """The :class:`FusedLayout` a ``fused_colwise`` plan entry describes."""
    return FusedLayout(options["order"], int(options["heads"]), int(options["kv_heads"]), int(options["head_dim"]))
