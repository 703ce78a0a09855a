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

What each record's bytes mean: :mod:`lightning_dist.profiling.comm_traffic`; the records:
:mod:`lightning_dist.profiling.comm_records`; labelling forward/backward/optimizer phases:
:mod:`lightning_dist.profiling.phase_hooks`.

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
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

from torch.distributed.tensor import DTensor
from typing_extensions import Self

from lightning_dist.compat import (
    TorchDispatchMode,
    current_dispatch_mode,
    in_autograd_backward,
    is_higher_order_operator,
    metadata_ops,
    op_overload_packet,
)
from lightning_dist.profiling.comm_records import (
    BYTE_FIELDS,
    UNLABELED,
    CommRecord,
    NodeTopology,
    aggregate,
    canonical_op_name,
    dtype_name,
    empty_stats,
)
from lightning_dist.profiling.comm_traffic import (
    Handler,
    OpGroup,
    Traffic,
    bind_arguments,
    handler_table,
    resolve_group,
)

__all__ = ["CommCounter"]


class _CommDispatchMode(TorchDispatchMode):
    """Dispatch mode that reports collective ops to a :class:`CommCounter` and passes every op through."""

    def __init__(self, counter: CommCounter) -> None:
        super().__init__()
        self._counter = counter
        self._passed_on = metadata_ops()

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self._passed_on or is_higher_order_operator(func):
            return func(*args, **kwargs)
        if not self._counter.observe(func, args, kwargs) and any(issubclass(t, DTensor) for t in types):
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
        handler_table()
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

    def observe(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        """Record ``func`` if it is a collective; whether it was. For a dispatch mode of the caller's that sees every
        op (the dry run's fake tensor mode) and would otherwise need this counter's own mode beside it."""
        if is_higher_order_operator(func):
            return False
        entry = handler_table().get(op_overload_packet(func))
        if entry is None:
            return False
        self._observe(entry[0], entry[1], func, args, kwargs)
        return True

    def _observe(self, api: str, handler: Handler, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        try:
            bound = bind_arguments(func, args, kwargs)
            group = resolve_group(bound)
            traffic = handler(bound, group.index, group.size)
            async_op = True if api == "functional" else bound.get("async_op")
            self._records.extend(self._to_record(api, t, group, async_op) for t in traffic)
        except Exception as err:  # noqa: BLE001 (never let accounting break the training step)
            self.dropped += 1
            warnings.warn(f"CommCounter could not account for {func}: {err!r}", RuntimeWarning, stacklevel=2)

    def _to_record(self, api: str, traffic: Traffic, group: OpGroup, async_op: bool | None) -> CommRecord:
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
            phase=self.backward_phase if self.backward_phase is not None and in_autograd_backward() else self._phase,
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
        return {op: stats[field] for op, stats in aggregate(self._records, lambda r: r.op).items()}

    def summary(self) -> dict[str, Any]:
        """Return a JSON-serialisable summary: totals, and count + byte fields per op, phase, group size and dtype."""
        return {
            "topology": {"ranks_per_node": self.topology.ranks_per_node},
            "num_records": len(self._records),
            "dropped": self.dropped,
            "totals": aggregate(self._records, lambda r: "all").get("all", empty_stats()),
            "by_op": aggregate(self._records, lambda r: r.op),
            "by_phase": aggregate(self._records, lambda r: r.phase),
            "by_group_size": aggregate(self._records, lambda r: str(r.group_size)),
            "by_dtype": aggregate(self._records, lambda r: dtype_name(r.dtype)),
        }
