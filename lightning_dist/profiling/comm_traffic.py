"""Bytes of one collective: each dispatcher op's arguments turned into what this rank sends and to whom.

Byte fields of a :class:`~lightning_dist.profiling.CommRecord` (``n`` = group size, ``me`` = this rank's index in the group). For each op,
``d_j`` is the payload this rank must deliver to group member ``j != me`` under a direct (point-to-point) exchange:

* all_gather_into_tensor, all_gather: ``tensor_bytes`` = gathered output (n x shard); ``d_j`` = own shard (input).
* reduce_scatter_tensor, reduce_scatter: ``tensor_bytes`` = input (n chunks); ``d_j`` = the chunk destined to j.
* all_reduce: ``tensor_bytes`` = the tensor ``t``; ``d_j = 2t/n`` (modelled as reduce-scatter + all-gather).
* all_to_all_single, all_to_all: ``tensor_bytes`` = input; ``d_j`` = the input rows/chunk addressed to j
  (``input_split_sizes`` when given, else equal splits).
* broadcast: ``tensor_bytes`` = the tensor; the root delivers ``t`` to every j, other ranks send nothing.
* reduce, gather: ``tensor_bytes`` = this rank's input; non-roots deliver it to the root, the root sends nothing.
* scatter: ``tensor_bytes`` = this rank's output chunk; the root delivers chunk j to every j.
* send / recv (also isend / irecv / batch_isend_irecv): ``tensor_bytes`` = the tensor; send: ``d_peer = t``;
  recv: nothing.

* ``sent_bytes = sum_j d_j``. For all-gather, reduce-scatter, all-reduce and all-to-all this equals the per-rank
  volume of the standard ring / direct algorithms: ``(n-1)/n * out``, ``(n-1)/n * in``, ``2(n-1)/n * t`` and the
  input minus the rank's own chunk.
* ``cross_node_bytes = sum over off-node j of d_j`` (``NodeTopology``): the bytes whose *destination* is on another
  node, i.e. all-gather: shard x off-node peers; reduce-scatter / all-to-all: the chunks addressed to off-node peers;
  all-reduce: ``2t/n`` x off-node peers; send: the tensor when the peer is off-node. It does not model routing (a
  hierarchical or ring algorithm moves the same payload over different links), so it is an algorithm-light measure
  that is always ``<= sent_bytes``. All-reduce fractions are rounded down to whole bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

from lightning_dist.compat import collective_op_namespaces, op_schema_arguments, resolve_process_group

# --------------------------------------------------------------------------------------------------------------------
# Traffic model: what one op moves, independent of the group and topology.
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Payload of one op: logical bytes and ``d_j`` per destination group index (see the module docstring)."""

    op: str
    dtype: torch.dtype
    tensor_bytes: int
    dest_bytes: Mapping[int, Fraction | int]
    peer_index: int | None = None  # group rank of the p2p peer or of the root


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_gather(op: str, inp: torch.Tensor, out_bytes: int, me: int, n: int) -> Traffic:
    shard = _nbytes(inp)
    return Traffic(op, inp.dtype, out_bytes, {j: shard for j in range(n) if j != me})


def _chunked(op: str, dtype: torch.dtype, chunks: Sequence[int], me: int) -> Traffic:
    """Reduce-scatter / all-to-all: chunk ``j`` of the input goes to group member ``j``."""
    return Traffic(op, dtype, sum(chunks), {j: c for j, c in enumerate(chunks) if j != me})


def _all_reduce(t: torch.Tensor, me: int, n: int) -> Traffic:
    share = Fraction(2 * _nbytes(t), n)
    return Traffic("all_reduce", t.dtype, _nbytes(t), {j: share for j in range(n) if j != me})


def _root_to_all(op: str, t: torch.Tensor, chunks: Sequence[int], root: int, me: int) -> Traffic:
    """Broadcast / scatter: the root delivers ``chunks[j]`` to every other member."""
    dest = {j: c for j, c in enumerate(chunks) if j != me} if me == root else {}
    return Traffic(op, t.dtype, _nbytes(t), dest, peer_index=root)


def _all_to_root(op: str, t: torch.Tensor, root: int, me: int) -> Traffic:
    """Reduce / gather: every non-root delivers its tensor to the root."""
    return Traffic(op, t.dtype, _nbytes(t), {} if me == root else {root: _nbytes(t)}, peer_index=root)


def _p2p(send: bool, t: torch.Tensor, peer: int | None) -> Traffic:
    dest = {peer: _nbytes(t)} if send and peer is not None else {}
    return Traffic("send" if send else "recv", t.dtype, _nbytes(t), dest, peer_index=peer)


def _even_split_bytes(t: torch.Tensor, splits: Sequence[int], n: int) -> list[int]:
    """Bytes per destination of an all-to-all input split along dim 0 (equal splits when ``splits`` is empty)."""
    rows = t.shape[0] if t.dim() > 0 else 0
    row_bytes = _nbytes(t) // rows if rows else 0
    splits = [int(s) for s in splits] if splits else [rows // n] * n
    return [s * row_bytes for s in splits]


# --------------------------------------------------------------------------------------------------------------------
# Handlers: one per dispatcher op; ``a`` holds the op's arguments by schema name, ``me``/``n`` the group position.
# --------------------------------------------------------------------------------------------------------------------

Handler = Callable[[dict[str, Any], int, int], list[Traffic]]


def _c10d_handlers() -> dict[str, Handler]:
    return {
        "_allgather_base_": lambda a, me, n: [
            _all_gather("all_gather_into_tensor", a["input_tensor"], _nbytes(a["output_tensor"]), me, n)
        ],
        "allgather_into_tensor_coalesced_": lambda a, me, n: [
            _all_gather("all_gather_into_tensor", i, _nbytes(o), me, n) for o, i in zip(a["outputs"], a["inputs"])
        ],
        "allgather_": lambda a, me, n: [
            _all_gather("all_gather", i, sum(map(_nbytes, outs)), me, n)
            for outs, i in zip(a["output_tensors"], a["input_tensors"])
        ],
        "allgather_coalesced_": lambda a, me, n: [
            _all_gather("all_gather", i, sum(map(_nbytes, outs)), me, n)
            for outs, i in zip(a["output_lists"], a["input_list"])
        ],
        "_reduce_scatter_base_": lambda a, me, n: [
            _chunked("reduce_scatter_tensor", a["input_tensor"].dtype, [_nbytes(a["output_tensor"])] * n, me)
        ],
        "reduce_scatter_tensor_coalesced_": lambda a, me, n: [
            _chunked("reduce_scatter_tensor", i.dtype, [_nbytes(o)] * n, me) for o, i in zip(a["outputs"], a["inputs"])
        ],
        "reduce_scatter_": lambda a, me, n: [
            _chunked("reduce_scatter", chunks[0].dtype, [_nbytes(c) for c in chunks], me)
            for chunks in a["input_tensors"]
        ],
        "allreduce_": lambda a, me, n: [_all_reduce(t, me, n) for t in a["tensors"]],
        "allreduce_coalesced_": lambda a, me, n: [_all_reduce(t, me, n) for t in a["tensors"]],
        "broadcast_": lambda a, me, n: [
            _root_to_all("broadcast", t, [_nbytes(t)] * n, a["root_rank"], me) for t in a["tensors"]
        ],
        "reduce_": lambda a, me, n: [_all_to_root("reduce", t, a["root_rank"], me) for t in a["tensors"]],
        "gather_": lambda a, me, n: [_all_to_root("gather", t, a["root_rank"], me) for t in a["input_tensors"]],
        "scatter_": lambda a, me, n: [_scatter(a, me, n)],
        "alltoall_base_": lambda a, me, n: [
            _chunked(
                "all_to_all_single",
                a["input"].dtype,
                _even_split_bytes(a["input"], a["input_split_sizes"], n),
                me,
            )
        ],
        "alltoall_": lambda a, me, n: [
            _chunked("all_to_all", a["input_tensors"][0].dtype, [_nbytes(t) for t in a["input_tensors"]], me)
        ],
        "send": lambda a, me, n: [_p2p(True, t, a["dst"]) for t in a["tensors"]],
        "recv_": lambda a, me, n: [_p2p(False, t, a["src"]) for t in a["tensors"]],
        "recv_any_source_": lambda a, me, n: [_p2p(False, t, None) for t in a["tensors"]],
    }


def _scatter(a: dict[str, Any], me: int, n: int) -> Traffic:
    out = a["output_tensors"][0]
    root = a["root_rank"]
    chunks = [_nbytes(t) for t in a["input_tensors"][0]] if me == root else [0] * n
    return _root_to_all("scatter", out, chunks, root, me)


def _functional_handlers() -> dict[str, Handler]:
    def gather(a: dict[str, Any], me: int, n: int) -> list[Traffic]:
        inputs = a["inputs"] if "inputs" in a else [a["input"]]
        return [_all_gather("all_gather_into_tensor", t, _nbytes(t) * n, me, n) for t in inputs]

    def reduce_scatter(a: dict[str, Any], me: int, n: int) -> list[Traffic]:
        inputs = a["inputs"] if "inputs" in a else [a["input"]]
        return [_chunked("reduce_scatter_tensor", t.dtype, [_nbytes(t) // n] * n, me) for t in inputs]

    def all_reduce(a: dict[str, Any], me: int, n: int) -> list[Traffic]:
        inputs = a["inputs"] if "inputs" in a else [a["input"]]
        return [_all_reduce(t, me, n) for t in inputs]

    def all_to_all(a: dict[str, Any], me: int, n: int) -> list[Traffic]:
        t = a["input"]
        return [_chunked("all_to_all_single", t.dtype, _even_split_bytes(t, a["input_split_sizes"], n), me)]

    def broadcast(a: dict[str, Any], me: int, n: int) -> list[Traffic]:
        t = a["input"]
        return [_root_to_all("broadcast", t, [_nbytes(t)] * n, a["src"], me)]

    def batch_p2p(a: dict[str, Any], me: int, n: int) -> list[Traffic]:
        return [_p2p(kind == "isend", t, peer) for kind, peer, t in zip(a["op_list"], a["peer_list"], a["tensors"])]

    return {
        "all_gather_into_tensor": gather,
        "all_gather_into_tensor_out": gather,
        "all_gather_into_tensor_coalesced": gather,
        "reduce_scatter_tensor": reduce_scatter,
        "reduce_scatter_tensor_out": reduce_scatter,
        "reduce_scatter_tensor_coalesced": reduce_scatter,
        "all_reduce": all_reduce,
        "all_reduce_": all_reduce,
        "all_reduce_coalesced": all_reduce,
        "all_reduce_coalesced_": all_reduce,
        "all_to_all_single": all_to_all,
        "broadcast": broadcast,
        "broadcast_": broadcast,
        "isend": lambda a, me, n: [_p2p(True, a["tensor"], a["dst"])],
        "irecv": lambda a, me, n: [_p2p(False, a["tensor"], a["src"])],
        "batch_p2p_ops": batch_p2p,
    }


_HANDLER_TABLE: dict[Any, tuple[str, Handler]] | None = None


def handler_table() -> dict[Any, tuple[str, Handler]]:
    """Map ``OpOverloadPacket`` -> (api, handler); built lazily because the op namespaces load with distributed."""
    global _HANDLER_TABLE
    if _HANDLER_TABLE is None:
        handlers_of = {"c10d": _c10d_handlers(), "functional": _functional_handlers()}
        table: dict[Any, tuple[str, Handler]] = {}
        for api, namespaces in collective_op_namespaces().items():
            for namespace in namespaces:
                for name, handler in handlers_of[api].items():
                    try:
                        table[getattr(namespace, name)] = (api, handler)
                    except (AttributeError, RuntimeError):  # op absent from this build
                        continue
        _HANDLER_TABLE = table
    return _HANDLER_TABLE


def bind_arguments(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Name an op's arguments by its schema, filling in defaults (callers omit ``async_op=True``, for instance)."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(op_schema_arguments(func)):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


@dataclass(frozen=True)
class OpGroup:
    ranks: tuple[int, ...]  # global ranks by group rank; empty when unknown
    index: int  # this rank's group rank
    size: int


def resolve_group(bound: Mapping[str, Any]) -> OpGroup:
    """Find the process group of a c10d op (``process_group``) or functional op (``group_name``)."""
    group = bound.get("process_group", bound.get("group_name"))
    if isinstance(group, str):
        group = resolve_process_group(group)
    elif isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    try:
        ranks = tuple(dist.get_process_group_ranks(group))
    except (KeyError, RuntimeError, ValueError):  # a group not registered with torch.distributed
        ranks = ()
    return OpGroup(ranks=ranks, index=group.rank(), size=group.size())
