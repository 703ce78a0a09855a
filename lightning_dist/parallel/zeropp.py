"""ZeRO++ (arXiv 2306.10209) on FSDP2: quantized weight all-gather (qwZ), hierarchical partitioning (hpZ) and
quantized gradient reduce-scatter through a two-hop all-to-all (qgZ), as FSDP2 custom comms.

* qwZ: :class:`QuantizedAllGather`. Each rank quantizes its shard (blockwise int8, fp32 scale per block), the bytes
  are all-gathered, and every rank dequantizes every slot, its own included, so all ranks compute with identical
  weights. Only the all-gather over the full sharding group is quantized: with hpZ, FSDP2 keeps a 1/k slice of the
  (already dequantized) gathered weights after forward and re-gathers it in backward over the group of k ranks; that
  gather moves those values exactly, so backward uses bit for bit the weights forward used (re-quantizing them
  would change them a second time).
* hpZ: FSDP2's own ``reshard_after_forward=k`` (k = ranks per node), set by the strategy; here only
  :func:`leftover_param_modules`, which finds the embeddings/head to shard as units so hpZ covers them too.
* qgZ: :class:`QuantizedReduceScatter`. Hop 1 inside the node: quantize, ``all_to_all_single`` over the node's
  ranks, dequantize and sum in fp32 (each rank now holds its node's partial sums for the chunks of every rank with its
  local index); hop 2 across nodes: re-quantize those partial sums, ``all_to_all_single`` over the ranks with the same
  local index on every node, dequantize and sum in fp32. Each rank ends with exactly its own FSDP shard, divided by
  the group size when FSDP asks for an average. Cross-node bytes per rank: ``(nodes - 1)`` chunks at ``bits/8`` bytes
  per element instead of ``(nodes - 1) * ranks_per_node`` chunks at full width.

Padding is handled here: any numel works (rows are padded to whole blocks and the padding is dropped on arrival).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_dist.compat import fsdp_collective_protocols

AllGather, ReduceScatter = fsdp_collective_protocols()

from lightning_dist.parallel.quantization import check_bits, check_block_size, pack, packed_nbytes, unpack


class _Quantized:
    """What both quantized collectives share: the checked quantization settings and FSDP2's buffer allocation."""

    def __init__(self, bits: int, block_size: int, compiled: bool = False) -> None:
        check_bits(bits)
        check_block_size(block_size)
        self.bits = bits
        self.block_size = block_size
        self.compiled = compiled

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class QuantizedAllGather(_Quantized, AllGather):
    """qwZ: FSDP2 all-gather of blockwise-quantized shards.

    Args:
        group_size: Size of the full sharding group. All-gathers over a different group (hpZ's backward re-gather
            inside a node) move the already dequantized values unchanged.
        bits: 8 (ZeRO++'s choice for weights) or 4.
        block_size: Elements per quantization block (one fp32 scale each).
        compiled: The quantization through ``torch.compile`` (:func:`~lightning_dist.parallel.quantization.pack`):
            the same bytes, fewer kernels.
    """

    def __init__(self, group_size: int, bits: int = 8, block_size: int = 256, compiled: bool = False) -> None:
        super().__init__(bits, block_size, compiled)
        self.group_size = group_size

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        if group.size() != self.group_size or not input_tensor.is_floating_point():
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        world, numel = group.size(), input_tensor.numel()
        # The input is a view into the output (this rank's slot): quantize it before anything is written there.
        send = pack(input_tensor.view(1, -1), self.bits, self.block_size, self.compiled)
        recv = torch.empty(world * send.shape[1], dtype=torch.uint8, device=send.device)
        dist.all_gather_single(recv, send.view(-1), group=group)
        values = unpack(recv.view(world, -1), numel, self.bits, self.block_size, output_tensor.dtype, self.compiled)
        output_tensor.view(world, numel).copy_(values)
        return None  # done synchronously: the dequantization needs the bytes


@dataclass(frozen=True)
class NodeGroups:
    """The sub-groups of one sharding group for a hierarchical all-to-all.

    The sharding group's rank ``g`` is local index ``g % ranks_per_node`` on node ``g // ranks_per_node``.

    Attributes:
        ranks_per_node: Ranks of the sharding group on each node.
        num_nodes: Nodes the sharding group spans.
        intra: This rank's node (``None`` when ``ranks_per_node == 1``).
        inter: The ranks with this rank's local index, one per node (``None`` when ``num_nodes == 1``).
    """

    ranks_per_node: int
    num_nodes: int
    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return self.ranks_per_node * self.num_nodes


def new_node_groups(group_ranks: Sequence[int], ranks_per_node: int) -> NodeGroups:
    """Create the intra-node and inter-node groups of a sharding group whose ranks are ``group_ranks``.

    Collective over the default group: every process must call it with the same arguments, in the same order
    relative to other group creations (each ``new_group`` is created by all ranks, members or not).
    """
    size = len(group_ranks)
    if ranks_per_node < 1 or size % ranks_per_node:
        raise ValueError(f"ranks_per_node={ranks_per_node} must divide the sharding group size {size}.")
    nodes = size // ranks_per_node
    me = dist.get_rank()
    intra = inter = None
    if ranks_per_node > 1:
        for n in range(nodes):
            ranks = list(group_ranks[n * ranks_per_node : (n + 1) * ranks_per_node])
            pg = dist.new_group(ranks)
            if me in ranks:
                intra = pg
    if nodes > 1:
        for local in range(ranks_per_node):
            ranks = list(group_ranks[local::ranks_per_node])
            pg = dist.new_group(ranks)
            if me in ranks:
                inter = pg
    return NodeGroups(ranks_per_node, nodes, intra, inter)


class QuantizedReduceScatter(_Quantized, ReduceScatter):
    """qgZ: FSDP2 reduce-scatter as a quantized two-hop all-to-all (inside the node, then across nodes).

    Honours the op FSDP2 passes: ``AVG`` returns the mean over the whole sharding group, ``SUM`` the sum (FSDP2
    then divides itself).

    Args:
        groups: The node groups of the sharding group (:func:`new_node_groups`).
        bits: 4 (ZeRO++'s choice for gradients) or 8.
        block_size: Elements per quantization block.
        compiled: The quantization through ``torch.compile``, as for :class:`QuantizedAllGather`.
    """

    def __init__(self, groups: NodeGroups, bits: int = 4, block_size: int = 256, compiled: bool = False) -> None:
        super().__init__(bits, block_size, compiled)
        self.groups = groups

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp | dist.ReduceOp.RedOpType,
        async_op: bool = False,
    ) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(
                f"The quantized reduce-scatter supports SUM and AVG, not {op}. (A gradient divide factor other than"
                " the group size makes FSDP2 use PREMUL_SUM.)"
            )
        world = group.size()
        if world != self.groups.size:
            raise ValueError(
                f"Reduce-scatter over {world} ranks, but the node groups were built for {self.groups.size}."
            )
        reduced = self.reduce_scatter(input_tensor.view(world, -1))
        if op == dist.ReduceOp.AVG:
            reduced = reduced / world
        output_tensor.copy_(reduced.view(-1))
        return None

    def reduce_scatter(self, chunks: Tensor) -> Tensor:
        """Sum over the group of ``chunks`` (``[group size, c]``, row ``g`` destined to group rank ``g``); returns this
        rank's fp32 ``[c]``."""
        nodes, local = self.groups.num_nodes, self.groups.ranks_per_node
        c = chunks.shape[1]
        # Row n*local + l goes to local index l of node n. Hop 1 sends to local peer l the rows of all nodes for l.
        partial = chunks.view(nodes, local, c).transpose(0, 1).reshape(local, nodes * c)
        partial = self._exchange(partial, self.groups.intra).view(nodes, c)  # this node's sums for my local index
        return self._exchange(partial, self.groups.inter).view(c)  # hop 2: each node's sums for me

    def _exchange(self, rows: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        """Send row ``i`` to group rank ``i`` quantized; return the fp32 sum of the rows received."""
        if group is None:  # a group of one: nothing to send
            return rows.to(torch.float32).sum(dim=0)
        numel = rows.shape[1]
        send = pack(rows, self.bits, self.block_size, self.compiled)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return unpack(recv, numel, self.bits, self.block_size, torch.float32, self.compiled).sum(dim=0)


def reduce_scatter_nbytes(numel: int, groups: NodeGroups, bits: int, block_size: int) -> dict[str, int]:
    """Bytes one rank sends in each hop of :class:`QuantizedReduceScatter` for an input of ``numel`` elements."""
    c = numel // groups.size
    return {
        "intra": (groups.ranks_per_node - 1) * packed_nbytes(groups.num_nodes * c, bits, block_size),
        "inter": (groups.num_nodes - 1) * packed_nbytes(c, bits, block_size),
    }


def leftover_param_modules(model: nn.Module, units: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The children of ``model`` that hold parameters outside every unit (embeddings, final norm, head).

    Sharding them as units of their own leaves the root without parameters, so hpZ's secondary partition covers
    every parameter (the root unit of a Lightning run is resharded after the ``training_step`` and re-gathered over the
    whole group in backward). Children that contain a unit, hold no parameters, or share a parameter with another
    child (tied embeddings) stay with the root.
    """
    unit_set = set(units)
    owners: dict[int, set[str]] = {id(p): {""} for p in model.parameters(recurse=False)}  # the root's own
    for name, child in model.named_children():
        for p in child.parameters():
            owners.setdefault(id(p), set()).add(name)
    out = []
    for name, child in model.named_children():
        params = list(child.parameters())
        if not params or child in unit_set or any(m in unit_set for m in child.modules()):
            continue
        if all(owners[id(p)] == {name} for p in params):
            out.append((name, child))
    return out


def install_comms(
    modules: Iterable[FSDPModule],
    all_gather: AllGather | None = None,
    reduce_scatter: ReduceScatter | None = None,
) -> int:
    """Set the custom all-gather and/or reduce-scatter on every FSDP module; returns how many modules got them."""
    count = 0
    for module in modules:
        if all_gather is not None:
            module.set_custom_all_gather(all_gather)
        if reduce_scatter is not None:
            module.set_custom_reduce_scatter(reduce_scatter)
        count += 1
    return count
