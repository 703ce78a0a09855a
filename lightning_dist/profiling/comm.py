"""Count the bytes of every collective a rank issues, whoever issues it.

:class:`CommCounter` is a context manager built on a :class:`~torch.utils._python_dispatch.TorchDispatchMode`. Every
collective of ``torch.distributed`` ends up as a dispatcher op, whoever calls it and however the Python function was
looked up (``dist.all_gather_single``, an imported alias, ``ProcessGroup.allreduce``, FSDP2's internals):

* the c10d Python API (``all_gather_into_tensor``/``all_gather_single``, ``all_gather``, ``reduce_scatter_tensor``/
  ``reduce_scatter_single``, ``reduce_scatter``, ``all_reduce``, ``broadcast``, ``reduce``, ``gather``, ``scatter``,
  ``all_to_all_single``, ``all_to_all``, ``send``/``isend``/``recv``/``irecv``, ``batch_isend_irecv``, the coalesced
  variants) reaches ``torch.ops.c10d.*``;
* functional collectives (``torch.distributed._functional_collectives``, used by DTensor) reach
  ``torch.ops._c10d_functional.*`` / ``torch.ops._c10d_functional_autograd.*``.

Why a dispatch mode rather than patching or a ``TorchFunctionMode`` (both were tried on torch 2.13):

* Patching ``torch.distributed.X`` misses callers that imported the function, double counts the API's internal
  calls (``all_gather_into_tensor`` -> ``all_gather_single``, ``send`` -> ``isend``) and breaks
  ``batch_isend_irecv``, which compares ``P2POp.op`` with the module's ``isend`` by identity.
* A ``TorchFunctionMode`` sees the c10d API calls, but it is popped while ``Tensor.backward`` runs, so FSDP2's
  backward all-gathers and reduce-scatters were missed; it also misses the collectives DTensor issues while it
  dispatches an op.
* A dispatch mode stays in the thread-local state that the autograd engine restores for backward, so backward hooks
  (FSDP2's reduce-scatter, re-gather) are seen. Like ``CommDebugMode`` it steps aside (``NotImplemented``) for
  DTensor so that it desugars first and the collectives it issues are counted.

Byte fields of a :class:`CommRecord` (``n`` = group size, ``me`` = this rank's index in the group). For each op,
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

Not intercepted (documented limits):

* Collectives issued from a thread other than the one that entered the counter (the mode is thread-local), except the
  autograd engine's backward threads, which inherit it. Async checkpoint threads are therefore not counted.
* Collectives issued from inside the ``__torch_dispatch__`` of a tensor subclass other than DTensor (the mode is
  suspended while it runs an op it handles). FSDP2's ``fsdp_pre_all_gather`` extension runs outside dispatch and is
  counted.
* Object collectives (``all_gather_object``, ``broadcast_object_list``, ...) are counted as the tensor collectives
  they issue (a size exchange plus a byte-tensor payload), not as object ops; ``barrier``/``monitored_barrier`` carry
  no payload and are not recorded.
* Traffic that does not go through a c10d or functional-collective op: NCCL work a backend performs internally,
  symmetric-memory / NVSHMEM kernels, and the legacy ``torch.ops.c10d_functional`` namespace. ``torch.compile`` with
  an active counter is untested: collectives inside a compiled graph are counted only if they still reach the
  dispatcher under the mode.
* ``async_op`` is the flag the op was issued with; for point-to-point ops it is ``None`` (``send`` and ``isend``
  issue the same async c10d op, the blocking wrapper waits in Python), for functional collectives it is ``True``.
* Peers of functional ``broadcast``/``isend``/``irecv`` are interpreted as group ranks (as the C++ kernels use them).

While active, the counter routes every tensor op through Python (a dispatch mode), which slows eager execution; use it
for profiling runs, not for timed benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import Self

from lightning_dist.compat import (
    TorchDispatchMode,
    current_dispatch_mode,
    load_functional_collectives,
    resolve_process_group,
)

__all__ = [
    "BYTE_FIELDS",
    "CommCounter",
    "CommRecord",
    "NodeTopology",
    "attach_phase_hooks",
    "canonical_op_name",
]

UNLABELED = "unlabeled"
BYTE_FIELDS = ("tensor_bytes", "sent_bytes", "cross_node_bytes")

# Other spellings of the same collective, so that queries accept the name the caller knows.
_OP_ALIASES = {
    "all_gather_single": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "isend": "send",
    "irecv": "recv",
}


def canonical_op_name(op: str) -> str:
    """Map an alias of a collective to the name used in :class:`CommRecord` (``all_gather_single`` ->
    ``all_gather_into_tensor``, ``reduce_scatter_single`` -> ``reduce_scatter_tensor``, ``isend`` -> ``send``, ...).

    Args:
        op: A collective's name as spelled by ``torch.distributed`` or the functional collectives.

    Returns:
        The canonical name (unknown names are returned unchanged).
    """
    return _OP_ALIASES.get(op, op)


@dataclass(frozen=True)
class NodeTopology:
    """Which global ranks share a node: rank ``r`` is on node ``r // ranks_per_node``.

    Args:
        ranks_per_node: Ranks per node; ``None`` puts every rank on one node (no cross-node traffic).
    """

    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1 or None, got {self.ranks_per_node}")

    @classmethod
    def from_env(cls, var: str = "LOCAL_WORLD_SIZE") -> NodeTopology:
        """Build the topology from an environment variable (``LOCAL_WORLD_SIZE``, set by ``torchrun``).

        Args:
            var: Name of the variable holding the number of ranks per node.

        Returns:
            ``NodeTopology(int(os.environ[var]))``, or the single-node topology when the variable is unset.
        """
        value = os.environ.get(var)
        return cls(int(value)) if value else cls()

    def node_of(self, rank: int) -> int:
        """Return the node index of global rank ``rank``."""
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def same_node(self, rank_a: int, rank_b: int) -> bool:
        """Return whether two global ranks are on the same node."""
        return self.node_of(rank_a) == self.node_of(rank_b)


@dataclass(frozen=True)
class CommRecord:
    """One collective (or one tensor of a coalesced collective) as seen by this rank.

    Attributes:
        op: Canonical op name (see :func:`canonical_op_name`), e.g. ``"all_gather_into_tensor"``, ``"send"``.
        api: ``"c10d"`` (``torch.distributed`` API, ``torch.ops.c10d``) or ``"functional"`` (functional collectives).
        group_size: Number of ranks in the process group.
        group_ranks: Global ranks of the group ordered by group rank (empty if the group is not registered with
            ``torch.distributed``).
        rank: This rank's global rank (``-1`` if unknown).
        dtype: Element type of the payload.
        tensor_bytes: Logical payload, see the module docstring.
        sent_bytes: Bytes this rank sends, see the module docstring.
        cross_node_bytes: Part of ``sent_bytes`` destined to ranks on other nodes.
        phase: Phase label active when the op was issued.
        async_op: ``async_op`` flag of the call (``None`` when not observable, as for point-to-point ops).
        peer: Global rank of the peer (point-to-point) or of the root (rooted collectives), else ``None``.
        spans_nodes: Whether the op's participants include a rank on another node (for point-to-point ops: whether
            the peer is on another node; ``False`` for a receive from any source).
    """

    op: str
    api: str
    group_size: int
    group_ranks: tuple[int, ...]
    rank: int
    dtype: torch.dtype
    tensor_bytes: int
    sent_bytes: int
    cross_node_bytes: int
    phase: str
    async_op: bool | None
    peer: int | None = None
    spans_nodes: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (the dtype as a string such as ``"bfloat16"``)."""
        out = dataclasses.asdict(self)
        out["dtype"] = _dtype_name(self.dtype)
        out["group_ranks"] = list(self.group_ranks)
        return out


# --------------------------------------------------------------------------------------------------------------------
# Traffic model: what one op moves, independent of the group and topology.
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Traffic:
    """Payload of one op: logical bytes and ``d_j`` per destination group index (see the module docstring)."""

    op: str
    dtype: torch.dtype
    tensor_bytes: int
    dest_bytes: Mapping[int, Fraction | int]
    peer_index: int | None = None  # group rank of the p2p peer or of the root


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_gather(op: str, inp: torch.Tensor, out_bytes: int, me: int, n: int) -> _Traffic:
    shard = _nbytes(inp)
    return _Traffic(op, inp.dtype, out_bytes, {j: shard for j in range(n) if j != me})


def _chunked(op: str, dtype: torch.dtype, chunks: Sequence[int], me: int) -> _Traffic:
    """Reduce-scatter / all-to-all: chunk ``j`` of the input goes to group member ``j``."""
    return _Traffic(op, dtype, sum(chunks), {j: c for j, c in enumerate(chunks) if j != me})


def _all_reduce(t: torch.Tensor, me: int, n: int) -> _Traffic:
    share = Fraction(2 * _nbytes(t), n)
    return _Traffic("all_reduce", t.dtype, _nbytes(t), {j: share for j in range(n) if j != me})


def _root_to_all(op: str, t: torch.Tensor, chunks: Sequence[int], root: int, me: int) -> _Traffic:
    """Broadcast / scatter: the root delivers ``chunks[j]`` to every other member."""
    dest = {j: c for j, c in enumerate(chunks) if j != me} if me == root else {}
    return _Traffic(op, t.dtype, _nbytes(t), dest, peer_index=root)


def _all_to_root(op: str, t: torch.Tensor, root: int, me: int) -> _Traffic:
    """Reduce / gather: every non-root delivers its tensor to the root."""
    return _Traffic(op, t.dtype, _nbytes(t), {} if me == root else {root: _nbytes(t)}, peer_index=root)


def _p2p(send: bool, t: torch.Tensor, peer: int | None) -> _Traffic:
    dest = {peer: _nbytes(t)} if send and peer is not None else {}
    return _Traffic("send" if send else "recv", t.dtype, _nbytes(t), dest, peer_index=peer)


def _even_split_bytes(t: torch.Tensor, splits: Sequence[int], n: int) -> list[int]:
    """Bytes per destination of an all-to-all input split along dim 0 (equal splits when ``splits`` is empty)."""
    rows = t.shape[0] if t.dim() > 0 else 0
    row_bytes = _nbytes(t) // rows if rows else 0
    splits = [int(s) for s in splits] if splits else [rows // n] * n
    return [s * row_bytes for s in splits]


# --------------------------------------------------------------------------------------------------------------------
# Handlers: one per dispatcher op; ``a`` holds the op's arguments by schema name, ``me``/``n`` the group position.
# --------------------------------------------------------------------------------------------------------------------

_Handler = Callable[[dict[str, Any], int, int], list[_Traffic]]


def _c10d_handlers() -> dict[str, _Handler]:
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


def _scatter(a: dict[str, Any], me: int, n: int) -> _Traffic:
    out = a["output_tensors"][0]
    root = a["root_rank"]
    chunks = [_nbytes(t) for t in a["input_tensors"][0]] if me == root else [0] * n
    return _root_to_all("scatter", out, chunks, root, me)


def _functional_handlers() -> dict[str, _Handler]:
    def gather(a: dict[str, Any], me: int, n: int) -> list[_Traffic]:
        inputs = a["inputs"] if "inputs" in a else [a["input"]]
        return [_all_gather("all_gather_into_tensor", t, _nbytes(t) * n, me, n) for t in inputs]

    def reduce_scatter(a: dict[str, Any], me: int, n: int) -> list[_Traffic]:
        inputs = a["inputs"] if "inputs" in a else [a["input"]]
        return [_chunked("reduce_scatter_tensor", t.dtype, [_nbytes(t) // n] * n, me) for t in inputs]

    def all_reduce(a: dict[str, Any], me: int, n: int) -> list[_Traffic]:
        inputs = a["inputs"] if "inputs" in a else [a["input"]]
        return [_all_reduce(t, me, n) for t in inputs]

    def all_to_all(a: dict[str, Any], me: int, n: int) -> list[_Traffic]:
        t = a["input"]
        return [_chunked("all_to_all_single", t.dtype, _even_split_bytes(t, a["input_split_sizes"], n), me)]

    def broadcast(a: dict[str, Any], me: int, n: int) -> list[_Traffic]:
        t = a["input"]
        return [_root_to_all("broadcast", t, [_nbytes(t)] * n, a["src"], me)]

    def batch_p2p(a: dict[str, Any], me: int, n: int) -> list[_Traffic]:
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


_HANDLER_TABLE: dict[Any, tuple[str, _Handler]] | None = None


def _handler_table() -> dict[Any, tuple[str, _Handler]]:
    """Map ``OpOverloadPacket`` -> (api, handler); built lazily because the op namespaces load with distributed."""
    global _HANDLER_TABLE
    if _HANDLER_TABLE is None:
        load_functional_collectives()

        table: dict[Any, tuple[str, _Handler]] = {}
        for namespace, api, handlers in (
            ("c10d", "c10d", _c10d_handlers()),
            ("_c10d_functional", "functional", _functional_handlers()),
            ("_c10d_functional_autograd", "functional", _functional_handlers()),
        ):
            for name, handler in handlers.items():
                try:
                    table[getattr(getattr(torch.ops, namespace), name)] = (api, handler)
                except (AttributeError, RuntimeError):  # op absent from this build
                    continue
        _HANDLER_TABLE = table
    return _HANDLER_TABLE


def _bind(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Name an op's arguments by its schema, filling in defaults (callers omit ``async_op=True``, for instance)."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


@dataclass(frozen=True)
class _Group:
    ranks: tuple[int, ...]  # global ranks by group rank; empty when unknown
    index: int  # this rank's group rank
    size: int


def _resolve_group(bound: Mapping[str, Any]) -> _Group:
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
    return _Group(ranks=ranks, index=group.rank(), size=group.size())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _in_backward() -> bool:
    """Whether the autograd engine is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


# --------------------------------------------------------------------------------------------------------------------
# The counter
# --------------------------------------------------------------------------------------------------------------------


class _CommDispatchMode(TorchDispatchMode):
    """Dispatch mode that reports collective ops to a :class:`CommCounter` and passes every op through."""

    def __init__(self, counter: CommCounter) -> None:
        super().__init__()
        self._counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        entry = _handler_table().get(func._overloadpacket)
        if entry is not None:
            self._counter._observe(entry[0], entry[1], func, args, kwargs)
        elif any(issubclass(t, DTensor) for t in types):
            # Let DTensor run first: the collectives it issues while dispatching come back through this mode. Other
            # subclasses run as usual: sending back FakeTensor (DTensor's sharding propagation) fails the dispatch.
            return NotImplemented
        return func(*args, **kwargs)


class CommCounter:
    """Context manager recording a :class:`CommRecord` for every collective this rank issues while active.

    Example::

        counter = CommCounter(NodeTopology(ranks_per_node=8))
        with counter:
            with counter.phase("forward"):
                loss = model(batch).sum()
            with counter.phase("backward"):
                loss.backward()
        counter.total("sent_bytes", op="all_gather_into_tensor", phase="forward")
        json.dumps(counter.summary())

    Records accumulate across activations until :meth:`reset`. Two counters may be nested (both record); entering one
    counter twice at the same time raises ``RuntimeError``, as does exiting counters out of order.

    Args:
        topology: Node layout used for ``cross_node_bytes``; default: all ranks on one node.
        backward_phase: If set, collectives issued while the autograd engine runs a backward pass are labelled with
            this phase regardless of the current one (see :func:`attach_phase_hooks`).
    """

    def __init__(self, topology: NodeTopology | None = None, *, backward_phase: str | None = None) -> None:
        self.topology = topology if topology is not None else NodeTopology()
        self.backward_phase = backward_phase
        self._phase = UNLABELED
        self._records: list[CommRecord] = []
        self._mode: _CommDispatchMode | None = None
        self.dropped = 0  # ops whose accounting failed (a warning is emitted); the op itself still ran

    # -- activation -------------------------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        if self._mode is not None:
            raise RuntimeError("This CommCounter is already active; use a second CommCounter to nest.")
        _handler_table()
        mode = _CommDispatchMode(self)
        mode.__enter__()
        self._mode = mode
        return self

    def __exit__(self, *exc_info: object) -> None:
        mode = self._mode
        if mode is None:
            raise RuntimeError("CommCounter.__exit__ called without a matching __enter__.")
        if current_dispatch_mode() is not mode:
            raise RuntimeError(
                "CommCounter exited out of order: another dispatch mode (or counter) entered inside it is still "
                "active. Exit nested counters/modes first."
            )
        self._mode = None
        mode.__exit__(*exc_info)

    @property
    def active(self) -> bool:
        """Whether the counter is currently recording."""
        return self._mode is not None

    # -- phases -----------------------------------------------------------------------------------------------------

    @property
    def current_phase(self) -> str:
        """The label given to collectives issued now (outside backward, see ``backward_phase``)."""
        return self._phase

    def set_phase(self, name: str) -> None:
        """Label the collectives issued from now on with ``name``."""
        self._phase = name

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the collectives issued inside the ``with`` block with ``name``; restore the previous label after."""
        previous = self._phase
        self._phase = name
        try:
            yield
        finally:
            self._phase = previous

    # -- recording --------------------------------------------------------------------------------------------------

    def _observe(self, api: str, handler: _Handler, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        try:
            bound = _bind(func, args, kwargs)
            group = _resolve_group(bound)
            traffic = handler(bound, group.index, group.size)
            async_op = True if api == "functional" else bound.get("async_op")
            self._records.extend(self._to_record(api, t, group, async_op) for t in traffic)
        except Exception as err:  # noqa: BLE001 (never let accounting break the training step)
            self.dropped += 1
            warnings.warn(f"CommCounter could not account for {func}: {err!r}", RuntimeWarning, stacklevel=2)

    def _to_record(self, api: str, traffic: _Traffic, group: _Group, async_op: bool | None) -> CommRecord:
        ranks = group.ranks
        me = ranks[group.index] if ranks else -1
        off_node = {j for j, r in enumerate(ranks) if not self.topology.same_node(r, me)} if ranks else set()
        sent = sum(traffic.dest_bytes.values(), Fraction(0))
        cross = sum((b for j, b in traffic.dest_bytes.items() if j in off_node), Fraction(0))
        peer = traffic.peer_index
        p2p = traffic.op in ("send", "recv")
        spans = (peer in off_node) if p2p else bool(off_node)
        return CommRecord(
            op=traffic.op,
            api=api,
            group_size=group.size,
            group_ranks=ranks,
            rank=me,
            dtype=traffic.dtype,
            tensor_bytes=int(traffic.tensor_bytes),
            sent_bytes=int(sent),
            cross_node_bytes=int(cross),
            phase=self.backward_phase if self.backward_phase is not None and _in_backward() else self._phase,
            async_op=None if p2p or async_op is None else bool(async_op),
            peer=ranks[peer] if ranks and peer is not None and 0 <= peer < len(ranks) else None,
            spans_nodes=spans,
        )

    # -- queries ----------------------------------------------------------------------------------------------------

    @property
    def records(self) -> list[CommRecord]:
        """A copy of the records, in issue order."""
        return list(self._records)

    def reset(self) -> None:
        """Drop all records (the phase label is kept)."""
        self._records.clear()
        self.dropped = 0

    def filter(
        self,
        op: str | Iterable[str] | None = None,
        phase: str | None = None,
        cross_node: bool | None = None,
    ) -> list[CommRecord]:
        """Return the records matching every given criterion.

        Args:
            op: Op name or names (aliases accepted, see :func:`canonical_op_name`).
            phase: Phase label.
            cross_node: ``True``: only ops in which this rank exchanges data with another node (``spans_nodes``);
                ``False``: only ops that stay within the node.

        Returns:
            The matching records in issue order.
        """
        ops = None if op is None else {canonical_op_name(o) for o in ([op] if isinstance(op, str) else op)}
        return [
            r
            for r in self._records
            if (ops is None or r.op in ops)
            and (phase is None or r.phase == phase)
            and (cross_node is None or r.spans_nodes == cross_node)
        ]

    def total(
        self,
        field: str = "sent_bytes",
        op: str | Iterable[str] | None = None,
        phase: str | None = None,
        cross_node: bool | None = None,
    ) -> int:
        """Sum a byte field (or ``"count"``) over the records selected as in :meth:`filter`.

        Args:
            field: One of ``tensor_bytes``, ``sent_bytes``, ``cross_node_bytes`` or ``count``.
            op: See :meth:`filter`.
            phase: See :meth:`filter`.
            cross_node: See :meth:`filter`.

        Returns:
            The sum (or the number of records for ``"count"``).
        """
        if field != "count" and field not in BYTE_FIELDS:
            raise ValueError(f"field must be one of {BYTE_FIELDS + ('count',)}, got {field!r}")
        selected = self.filter(op=op, phase=phase, cross_node=cross_node)
        return len(selected) if field == "count" else sum(getattr(r, field) for r in selected)

    def by_op(self, field: str = "sent_bytes") -> dict[str, int]:
        """Return ``{op: total of field}`` over all records."""
        return {op: stats[field] for op, stats in _aggregate(self._records, lambda r: r.op).items()}

    def summary(self) -> dict[str, Any]:
        """Return a JSON-serialisable summary: totals, and count + byte fields per op, phase, group size and dtype."""
        return {
            "topology": {"ranks_per_node": self.topology.ranks_per_node},
            "num_records": len(self._records),
            "dropped": self.dropped,
            "totals": _aggregate(self._records, lambda r: "all").get("all", _empty_stats()),
            "by_op": _aggregate(self._records, lambda r: r.op),
            "by_phase": _aggregate(self._records, lambda r: r.phase),
            "by_group_size": _aggregate(self._records, lambda r: str(r.group_size)),
            "by_dtype": _aggregate(self._records, lambda r: _dtype_name(r.dtype)),
        }


def _empty_stats() -> dict[str, int]:
    return {"count": 0, **{f: 0 for f in BYTE_FIELDS}}


def _aggregate(records: Iterable[CommRecord], key: Callable[[CommRecord], str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(_empty_stats)
    for r in records:
        stats = out[key(r)]
        stats["count"] += 1
        for f in BYTE_FIELDS:
            stats[f] += getattr(r, f)
    return dict(out)


# --------------------------------------------------------------------------------------------------------------------
# Phase hooks
# --------------------------------------------------------------------------------------------------------------------


class _PhaseHooks:
    """Removable handle returned by :func:`attach_phase_hooks`."""

    def __init__(self, counter: CommCounter, handles: list[Any], previous_backward_phase: str | None) -> None:
        self._counter = counter
        self._handles = handles
        self._previous_backward_phase = previous_backward_phase

    def remove(self) -> None:
        """Remove the hooks and restore the counter's ``backward_phase``."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._counter.backward_phase = self._previous_backward_phase


def attach_phase_hooks(
    module: nn.Module,
    counter: CommCounter,
    forward: str = "forward",
    backward: str = "backward",
    optimizers: Iterable[torch.optim.Optimizer] = (),
    optimizer: str = "optimizer",
) -> _PhaseHooks:
    """Label collectives with ``forward`` / ``backward`` (/ ``optimizer``) automatically.

    * ``forward``: from a forward pre-hook on ``module`` (prepended) to its forward post-hook, which restores the
      previous label.
    * ``backward``: every collective issued while the autograd engine runs a backward pass (sets
      ``counter.backward_phase``), including hooks and final callbacks queued by FSDP2.
    * ``optimizer``: between the step pre- and post-hooks of the given optimizers.

    Limits: attach *after* ``fully_shard``/parallelisation so the pre-hook runs before FSDP2's pre-forward all-gather
    (hooks run in registration order; both are prepended). Forward recomputation of activation checkpointing runs
    inside backward and is labelled ``backward``. Collectives outside these windows (gradient clipping outside
    ``optimizer.step``, validation without a forward of ``module``) keep the surrounding label.

    Args:
        module: The root module whose forward delimits the forward phase.
        counter: The counter to label.
        forward: Label of the forward phase.
        backward: Label of the backward phase.
        optimizers: Optimizers whose ``step`` delimits the optimizer phase.
        optimizer: Label of the optimizer phase.

    Returns:
        A handle whose ``remove()`` detaches the hooks.
    """
    saved: list[str] = []

    def enter(label: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            saved.append(counter.current_phase)
            counter.set_phase(label)

        return hook

    def leave(*_: Any) -> None:
        if saved:
            counter.set_phase(saved.pop())

    handles = [
        module.register_forward_pre_hook(enter(forward), prepend=True),
        module.register_forward_hook(leave, always_call=True),
    ]
    for opt in optimizers:
        handles.append(opt.register_step_pre_hook(enter(optimizer)))
        handles.append(opt.register_step_post_hook(leave))
    previous = counter.backward_phase
    counter.backward_phase = backward
    return _PhaseHooks(counter, handles, previous)
