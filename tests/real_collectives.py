"""An independent record of the collectives a real rank issued: torch's profiler plus torch's flight recorder.

:class:`RealCollectiveLog` is entered inside one rank process and, on exit, lists the collectives that rank issued, in
order, as ``{"kind", "bytes", "group", "peer"}`` dicts. It uses none of ``lightning_dist``'s bookkeeping (no
``CommCounter``, no ``comm_traffic``): only

* ``torch.profiler.profile(activities=[CPU], record_shapes=True, profile_memory=True)``. The events are read from the
  profiler's own event tree (``prof.profiler.kineto_results.experimental_event_tree()``, what
  ``torch.profiler._memory_profiler`` reads) rather than ``prof.events()``: ``FunctionEvent`` has no dtype for a
  ``Tensor[]`` argument (``input_dtypes`` says ``"TensorList"``, so an ``all_reduce`` of bf16 would be unsized) and its
  ``[memory]`` events lack the allocator's running total; the tree has both, with nanosecond timestamps and parents;
* the flight recorder, ``json.loads(torch._C._distributed_c10d._dump_fr_trace_json())["entries"]``, for the process
  group of each collective (the profiler does not record the ``ProcessGroup`` argument).

Which events count. Every dispatcher op named ``c10d::*``, ``_c10d_functional::*`` or ``_c10d_functional_autograd::*``
that is not nested inside another such op (a functional collective runs a ``c10d::*`` op inside itself; a
``TorchDispatchMode`` such as ``CommCounter`` re-dispatches the op it intercepts, which the profiler records a second
time, nested). Ops that move no payload (``c10d::barrier``, ``monitored_barrier_``, ``_c10d_functional::wait_tensor``,
``_wrap_tensor_autograd``) are dropped; an op of those namespaces missing from the table below is dropped too and its
name kept in ``unrecognized``. A coalesced op yields one entry per tensor, as ``CommCounter`` does.

``kind`` (``CommCounter``'s canonical names, ``lightning_dist/profiling/comm_traffic.py``) and ``bytes`` (its
``tensor_bytes``: numel x element size):

=====================================================  =======================  ===========================================
op                                                     kind                     bytes
=====================================================  =======================  ===========================================
c10d::_allgather_base_                                 all_gather_into_tensor   output
c10d::allgather_into_tensor_coalesced_                 all_gather_into_tensor   each output
c10d::allgather_, allgather_coalesced_                 all_gather               all outputs: the flight recorder's
                                                                                ``output_sizes`` (``Tensor[][]`` is not
                                                                                recorded by the profiler), else
                                                                                len(group) x input; None if neither
c10d::_reduce_scatter_base_                            reduce_scatter_tensor    input (= n x output, torch checks it)
c10d::reduce_scatter_tensor_coalesced_                 reduce_scatter_tensor    each input
c10d::reduce_scatter_                                  reduce_scatter           the flight recorder's ``input_sizes``
                                                                                (``Tensor[][]``), else None
c10d::allreduce_, allreduce_coalesced_                 all_reduce               each tensor
c10d::broadcast_ / reduce_                             broadcast / reduce       each tensor
c10d::gather_ / scatter_                               gather / scatter         input / the output
c10d::alltoall_base_                                   all_to_all_single        input (= the sum of the split rows)
c10d::alltoall_                                        all_to_all               sum of the inputs
c10d::send / recv_, recv_any_source_                   send / recv              each tensor
_c10d_functional(_autograd)::all_gather_into_tensor*   all_gather_into_tensor   group_size x input
_c10d_functional(_autograd)::reduce_scatter_tensor*    reduce_scatter_tensor    input // group_size x group_size
_c10d_functional::all_reduce*                          all_reduce               each input
_c10d_functional(_autograd)::all_to_all_single         all_to_all_single        input
_c10d_functional::broadcast*                           broadcast                input
_c10d_functional::isend / irecv                        send / recv              the tensor
_c10d_functional::batch_p2p_ops                        batch_p2p                each tensor (``op_list`` is a ``str[]``,
                                                                                which the profiler does not record)
=====================================================  =======================  ===========================================

``group``: the global ranks (ordered by group rank) of each non-point-to-point collective. The flight recorder logs one
entry per collective op with ``process_group: [name, desc]``; the name is mapped to ranks through
``torch.distributed.distributed_c10d._world.pg_names`` and ``get_process_group_ranks`` (snapshotted at every
:meth:`RealCollectiveLog.mark` and at exit, so a group destroyed before exit is still known if it was alive at a mark).
The entries of the window (``record_id`` above the last one seen at enter) are matched to the profiler's top-level ops
by ORDER (gloo logs a ``reduce_scatter_tensor`` as ``gloo:all_reduce``, so kinds are not compared), barriers included
on both sides; a list-form ``c10d::reduce_scatter_`` takes the ``n`` consecutive ``*:all_reduce`` entries of its group
when it finds them (gloo runs one all-reduce per chunk), else one. If the counts differ, or a matched pair's input numel differs where both are known, no group is guessed:
every ``group`` is None and ``groups_aligned`` is False. ``TORCH_FR_BUFFER_SIZE`` is set to 20000 in ``__enter__``
unless already set; torch reads it when the recorder is first used (the first collective), so a log entered before
``init_process_group`` is enough (torch 2.13 records on gloo without it too, with a smaller default buffer); a window
holding more entries than the buffer fails to align.

``peer``: the other end of a ``send``/``recv``, or the root of ``broadcast``/``reduce``/``gather``/``scatter`` (as
``CommCounter``'s ``peer``), else None. The op's argument (``dst``/``src``/``root_rank``) is a GROUP rank; it is turned
into a global rank through ``group`` when that is known, and left as the group rank when ``group`` is None. gloo does
not log point-to-point ops in the flight recorder, so a gloo ``send``/``recv`` always has ``group`` None and a
group-rank ``peer`` (the same as the global rank on the default group, or any group whose ranks are ``0..n-1`` in
order). Where the recorder does log p2p ops (``is_p2p``, e.g. NCCL) and their count matches the profiler's, they are
matched by order too (``p2p_groups_aligned``).

Memory: ``peak_bytes`` is the maximum of the CPU allocator's "Total Allocated" over the window (the profiler's
allocation events, device ``cpu``), ``start_bytes`` the first event's total minus its own size. torch's CPU reporter
only counts allocations made while memory profiling is on (``ProfiledCPUMemoryReporter``), so tensors created before
``__enter__`` are not in the totals: enter the log before building the model to count its parameters.
:meth:`RealCollectiveLog.mark` records a zero-length ``record_function`` whose start time is read back from the same
event tree, so :meth:`peak_between`/:meth:`collectives_between` cut the window on the profiler's own clock.

Known limits: collectives issued from any thread are recorded (``CommCounter`` sees only its own thread and the
autograd engine's); ops issued directly on a ``Backend`` object, or inside a compiled graph that never reaches the
dispatcher, are not seen by the profiler (their flight-recorder entries then break the alignment: groups go None);
``_c10d_functional::batch_p2p_ops`` entries have kind ``batch_p2p``.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
from typing_extensions import Self

FR_BUFFER_VARIABLE = "TORCH_FR_BUFFER_SIZE"
FR_BUFFER_SIZE = "20000"
MARK_PREFIX = "real_collective_log.mark:"
P2P_KINDS = frozenset({"send", "recv", "batch_p2p"})
# Payload-free ops that still take a flight-recorder entry (kept for alignment, then dropped).
BARRIERS = frozenset({"c10d::barrier", "c10d::monitored_barrier_"})
_NAMESPACES = ("c10d::", "_c10d_functional::", "_c10d_functional_autograd::")
_SKIP = object()  # a known op of those namespaces that is no collective (wait_tensor, ...)


# --------------------------------------------------------------------------------------------------------------------
# One profiler op turned into collective entries
# --------------------------------------------------------------------------------------------------------------------


def _numel(sizes: Any) -> int:
    return math.prod(int(s) for s in sizes)


def _nbytes(meta: Any) -> int:
    """Bytes of a recorded ``_TensorMetadata`` (numel x element size, as ``Tensor.numel() * element_size()``)."""
    return _numel(meta.sizes) * meta.dtype.itemsize


def _tensors(value: Any) -> list[Any]:
    """The tensors of a ``Tensor`` or ``Tensor[]`` argument (undefined ones left out)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    return [t for t in items if t is not None and hasattr(t, "sizes") and hasattr(t, "dtype")]


def _fr_numel(sizes: Any) -> int | None:
    if not isinstance(sizes, list):
        return None
    return sum(_numel(s) for s in sizes)


@dataclass
class _Entry:
    kind: str
    bytes: int | None = None
    peer: int | None = None  # group rank of the p2p peer or of the root
    # bytes that need the flight recorder's entry or the group: f(fr_entry or None, group or None) -> int | None
    resolve: Callable[[dict[str, Any] | None, list[int] | None], int | None] | None = None


@dataclass
class _Op:
    name: str
    start_ns: int
    entries: list[_Entry]
    p2p: bool
    input_numel: int | None  # what the flight recorder's ``input_sizes`` should add up to (None: not checked)
    per_chunk_entries: bool = False  # c10d::reduce_scatter_: gloo logs one all_reduce per chunk
    fr: dict[str, Any] | None = None
    group: list[int] | None = None


def _gather_from_fr(inp: Any) -> Callable[[dict[str, Any] | None, list[int] | None], int | None]:
    """all_gather (list form): output numel from the flight recorder, else len(group) x input."""

    def resolve(fr: dict[str, Any] | None, group: list[int] | None) -> int | None:
        numel = _fr_numel(fr.get("output_sizes")) if fr is not None else None
        if numel:
            return numel * inp.dtype.itemsize
        return len(group) * _nbytes(inp) if group else None

    return resolve


def _scatter_input_from_fr(out: Any) -> Callable[[dict[str, Any] | None, list[int] | None], int | None]:
    """reduce_scatter (list form): the chunks' numel from the flight recorder's ``input_sizes``."""

    def resolve(fr: dict[str, Any] | None, group: list[int] | None) -> int | None:
        numel = _fr_numel(fr.get("input_sizes")) if fr is not None else None
        return numel * out.dtype.itemsize if numel else None

    return resolve


def _c10d(name: str, a: dict[str, Any]) -> tuple[list[_Entry], int | None] | None:
    """Entries of a ``c10d::`` op and the input numel the flight recorder should report; None if unknown op."""
    t = _tensors
    if name == "_allgather_base_":
        (out,), (inp,) = t(a["output_tensor"]), t(a["input_tensor"])
        return [_Entry("all_gather_into_tensor", _nbytes(out))], _numel(inp.sizes)
    if name == "allgather_into_tensor_coalesced_":
        outs, ins = t(a["outputs"]), t(a["inputs"])
        return [_Entry("all_gather_into_tensor", _nbytes(o)) for o in outs], sum(_numel(i.sizes) for i in ins)
    if name in ("allgather_", "allgather_coalesced_"):
        ins = t(a["input_tensors" if name == "allgather_" else "input_list"])
        if len(ins) == 1:
            entries = [_Entry("all_gather", resolve=_gather_from_fr(ins[0]))]
        else:  # several inputs share one recorder entry: n x input each
            entries = [_Entry("all_gather", resolve=lambda fr, g, i=i: len(g) * _nbytes(i) if g else None) for i in ins]
        return entries, sum(_numel(i.sizes) for i in ins)
    if name == "_reduce_scatter_base_":
        (inp,) = t(a["input_tensor"])
        return [_Entry("reduce_scatter_tensor", _nbytes(inp))], _numel(inp.sizes)
    if name == "reduce_scatter_tensor_coalesced_":
        ins = t(a["inputs"])
        return [_Entry("reduce_scatter_tensor", _nbytes(i)) for i in ins], sum(_numel(i.sizes) for i in ins)
    if name == "reduce_scatter_":
        outs = t(a["output_tensors"])
        if len(outs) == 1:
            return [_Entry("reduce_scatter", resolve=_scatter_input_from_fr(outs[0]))], None
        return [_Entry("reduce_scatter") for _ in outs], None
    if name in ("allreduce_", "allreduce_coalesced_", "broadcast_", "reduce_"):
        kind = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce"}.get(name, name.rstrip("_"))
        ts = t(a["tensors"])
        root = a.get("root_rank")
        return [_Entry(kind, _nbytes(x), peer=root) for x in ts], sum(_numel(x.sizes) for x in ts)
    if name == "gather_":
        ins = t(a["input_tensors"])
        root = a.get("root_rank")
        return [_Entry("gather", _nbytes(i), peer=root) for i in ins], sum(_numel(i.sizes) for i in ins)
    if name == "scatter_":
        outs = t(a["output_tensors"])
        return [_Entry("scatter", _nbytes(outs[0]), peer=a.get("root_rank"))], None
    if name == "alltoall_base_":
        (inp,) = t(a["input"])
        return [_Entry("all_to_all_single", _nbytes(inp))], _numel(inp.sizes)
    if name == "alltoall_":
        ins = t(a["input_tensors"])
        return [_Entry("all_to_all", sum(map(_nbytes, ins)))], sum(_numel(i.sizes) for i in ins)
    if name in ("send", "recv_", "recv_any_source_"):
        peer = a.get("dst") if name == "send" else a.get("src")
        kind = "send" if name == "send" else "recv"
        return [_Entry(kind, _nbytes(x), peer=peer) for x in t(a["tensors"])], None
    if name in ("barrier", "monitored_barrier_"):
        return [], None
    return None


def _functional(name: str, a: dict[str, Any]) -> tuple[list[_Entry], int | None] | None:
    """Entries of a ``_c10d_functional(_autograd)::`` op (payload in ``input`` or ``inputs``)."""
    ins = _tensors(a.get("inputs", a.get("input")))
    numel = sum(_numel(i.sizes) for i in ins)
    base = name.removesuffix("_out").removesuffix("_coalesced_").removesuffix("_coalesced").removesuffix("_")
    n = a.get("group_size")
    if base == "all_gather_into_tensor":
        return [_Entry("all_gather_into_tensor", _nbytes(i) * n if n else None) for i in ins], numel
    if base == "reduce_scatter_tensor":
        return [_Entry("reduce_scatter_tensor", _nbytes(i) // n * n if n else None) for i in ins], numel
    if base in ("all_reduce", "broadcast", "all_to_all_single"):
        return [_Entry(base, _nbytes(i), peer=a.get("src")) for i in ins], numel
    if name in ("isend", "irecv"):
        (x,) = _tensors(a["tensor"])
        return [_Entry("send" if name == "isend" else "recv", _nbytes(x), peer=a.get("dst", a.get("src")))], None
    if name == "batch_p2p_ops":
        return [_Entry("batch_p2p", _nbytes(x)) for x in _tensors(a["tensors"])], None
    if name in ("wait_tensor", "_wrap_tensor_autograd"):
        return [], None
    return None


def _schema_names(qualified: str, overload: str) -> list[str] | None:
    namespace, name = qualified.split("::", 1)
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return [arg.name for arg in getattr(packet, overload or "default")._schema.arguments]
    except (AttributeError, RuntimeError):
        return None


# --------------------------------------------------------------------------------------------------------------------
# Flight recorder and process groups
# --------------------------------------------------------------------------------------------------------------------


def _fr_entries() -> list[dict[str, Any]]:
    try:
        return json.loads(torch._C._distributed_c10d._dump_fr_trace_json()).get("entries", [])
    except (AttributeError, RuntimeError, ValueError):
        return []


def _pg_name(entry: dict[str, Any]) -> str:
    return str((entry.get("process_group") or [None])[0])


def _group_ranks_by_name() -> dict[str, list[int]]:
    if not (dist.is_available() and dist.is_initialized()):
        return {}
    out: dict[str, list[int]] = {}
    for pg, name in dist.distributed_c10d._world.pg_names.items():
        try:
            out[str(name)] = [int(r) for r in dist.get_process_group_ranks(pg)]
        except (KeyError, RuntimeError, ValueError):
            continue
    return out


# --------------------------------------------------------------------------------------------------------------------
# The context manager
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class _Window:
    ops: list[_Op] = field(default_factory=list)
    memory: list[tuple[int, int, int]] = field(default_factory=list)  # (ns, total allocated, alloc size) CPU only
    marks: dict[str, list[int]] = field(default_factory=dict)
    unrecognized: list[str] = field(default_factory=list)


class RealCollectiveLog:
    """Record, in one real rank process, the collectives it issues and the CPU allocator's live bytes.

    Example (in each rank, e.g. around ``trainer.fit``; may be entered before ``init_process_group``)::

        log = RealCollectiveLog()
        with log:
            dist.init_process_group("gloo", ...)
            log.mark("step_start"); step(); log.mark("step_end")
        log.collectives                                   # [{"kind", "bytes", "group", "peer"}, ...]
        log.collectives_between("step_start", "step_end")
        log.peak_between("step_start", "step_end")

    Attributes set on exit: ``collectives``, ``collective_times_ns`` (profiler clock, parallel to ``collectives``),
    ``groups_aligned`` (non-p2p flight-recorder entries matched), ``p2p_groups_aligned``, ``peak_bytes``,
    ``start_bytes``, ``marks`` (name -> profiler-clock ns of each call), ``fr_entries`` (the window's raw recorder
    entries), ``unrecognized`` (collective-namespace ops not understood, dropped).
    """

    def __init__(self, memory: bool = True) -> None:
        self.memory = memory  # False: no allocator events (memory profiling keeps weak references to tensors)
        self._prof: profile | None = None
        self._fr_start = 0
        self._groups: dict[str, list[int]] = {}
        self.collectives: list[dict[str, Any]] = []
        self.collective_times_ns: list[int] = []
        self.groups_aligned = False
        self.p2p_groups_aligned = False
        self.peak_bytes = 0
        self.start_bytes = 0
        self.marks: dict[str, list[int]] = {}
        self.fr_entries: list[dict[str, Any]] = []
        self.unrecognized: list[str] = []
        self._memory: list[tuple[int, int, int]] = []

    def __enter__(self) -> Self:
        if self._prof is not None:
            raise RuntimeError("RealCollectiveLog is already active")
        os.environ.setdefault(FR_BUFFER_VARIABLE, FR_BUFFER_SIZE)  # read by torch on the recorder's first use
        self._fr_start = max((int(e["record_id"]) for e in _fr_entries()), default=-1) + 1
        self._groups = _group_ranks_by_name()
        self._prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=self.memory)
        self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        """Record a named instant (a zero-length ``record_function`` on the profiler's clock); may repeat."""
        if self._prof is None:
            raise RuntimeError("RealCollectiveLog.mark called outside the active window")
        with record_function(MARK_PREFIX + name):
            pass
        self._groups.update(_group_ranks_by_name())

    def __exit__(self, *exc_info: object) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            raise RuntimeError("RealCollectiveLog.__exit__ without __enter__")
        self._groups.update(_group_ranks_by_name())
        entries = [e for e in _fr_entries() if int(e["record_id"]) >= self._fr_start]
        prof.__exit__(None, None, None)
        try:
            self._build(prof, entries)
        except Exception:
            if exc_info[0] is None:
                raise
            warnings.warn("RealCollectiveLog could not read the profile", RuntimeWarning, stacklevel=2)

    # -- parsing ----------------------------------------------------------------------------------------------------

    def _build(self, prof: profile, fr: list[dict[str, Any]]) -> None:
        window = _Window()
        for root in prof.profiler.kineto_results.experimental_event_tree():
            self._walk(root, window)
        ops = sorted(window.ops, key=lambda op: op.start_ns)
        self.fr_entries = sorted(fr, key=lambda e: int(e["record_id"]))
        self.groups_aligned = self._align([op for op in ops if not op.p2p], [e for e in fr if not e.get("is_p2p")])
        p2p = [op for op in ops if op.p2p]
        self.p2p_groups_aligned = bool(p2p) and self._align(p2p, [e for e in fr if e.get("is_p2p")], check=False)
        self.collectives, self.collective_times_ns = [], []
        for op in ops:
            for entry in op.entries:
                nbytes = entry.bytes if entry.resolve is None else entry.resolve(op.fr, op.group)
                peer = entry.peer
                if peer is not None and op.group is not None:
                    peer = op.group[peer] if 0 <= peer < len(op.group) else None
                self.collectives.append({"kind": entry.kind, "bytes": nbytes, "group": op.group, "peer": peer})
                self.collective_times_ns.append(op.start_ns)
        self._memory = sorted(window.memory)
        self.marks = {k: sorted(v) for k, v in window.marks.items()}
        self.unrecognized = window.unrecognized
        if self._memory:
            self.peak_bytes = max(total for _, total, _ in self._memory)
            self.start_bytes = self._memory[0][1] - self._memory[0][2]

    def _walk(self, root: Any, window: _Window) -> None:
        """Collect the top-level collective ops, the CPU allocations and the marks under ``root`` (iteratively)."""
        stack = [(root, False)]  # (event, inside a collective-namespace op)
        while stack:
            event, inside = stack.pop()
            if event.tag == torch._C._profiler._EventType.Allocation:
                f = event.extra_fields
                if f.device.type == "cpu":
                    window.memory.append((event.start_time_ns, f.total_allocated, f.alloc_size))
            elif event.tag == torch._C._profiler._EventType.TorchOp:
                name = event.name
                if name.startswith(MARK_PREFIX):
                    window.marks.setdefault(name[len(MARK_PREFIX) :], []).append(event.start_time_ns)
                elif name.startswith(_NAMESPACES) and not inside:  # a nested one is part of its parent
                    op = self._parse_op(name, event)
                    if op is None:
                        window.unrecognized.append(name)
                    elif op is not _SKIP:
                        window.ops.append(op)
                    inside = True
            stack.extend((child, inside) for child in event.children)

    @staticmethod
    def _parse_op(name: str, event: Any) -> _Op | object | None:
        f = event.extra_fields
        names = _schema_names(name, getattr(f, "overload_name", ""))
        if names is None:
            return None
        args = dict(zip(names, f.inputs))
        namespace, short = name.split("::", 1)
        parsed = _c10d(short, args) if namespace == "c10d" else _functional(short, args)
        if parsed is None:
            return None
        entries, input_numel = parsed
        if not entries and name not in BARRIERS:  # wait_tensor & co: neither collectives nor recorder entries
            return _SKIP
        p2p = bool(entries) and all(e.kind in P2P_KINDS for e in entries)
        return _Op(
            name, event.start_time_ns, entries, p2p, input_numel, per_chunk_entries=name == "c10d::reduce_scatter_"
        )

    def _align(self, ops: list[_Op], fr: list[dict[str, Any]], check: bool = True) -> bool:
        """Attach recorder entries (and their groups) to ``ops`` by order; nothing if they cannot be matched.

        Each op takes one entry, except ``c10d::reduce_scatter_`` on gloo, which logs one ``all_reduce`` per chunk:
        it takes the ``n`` entries that follow when they all are ``*:all_reduce`` of the same group of size ``n``."""
        matched: list[tuple[_Op, list[dict[str, Any]]]] = []
        i = 0
        for op in ops:
            if i >= len(fr):
                return False
            take = 1
            if op.per_chunk_entries:
                name = _pg_name(fr[i])
                n = len(self._groups.get(name, ()))
                run = fr[i : i + n]
                if (
                    n > 1
                    and len(run) == n
                    and all(
                        _pg_name(e) == name and str(e.get("profiling_name", "")).endswith(":all_reduce") for e in run
                    )
                ):
                    take = n
            chunk = fr[i : i + take]
            i += take
            if check and op.input_numel is not None:
                numels = [_fr_numel(e.get("input_sizes")) for e in chunk]
                if None not in numels and sum(numels) != op.input_numel:
                    return False
            matched.append((op, chunk))
        if i != len(fr):
            return False
        for op, chunk in matched:
            op.fr = {
                "process_group": chunk[0].get("process_group"),
                "input_sizes": [s for e in chunk for s in e.get("input_sizes") or []],
                "output_sizes": [s for e in chunk for s in e.get("output_sizes") or []],
            }
            name = _pg_name(chunk[0])
            op.group = list(self._groups[name]) if name in self._groups else None
        return True

    # -- queries ----------------------------------------------------------------------------------------------------

    def _mark_ns(self, name: str, occurrence: int) -> int:
        try:
            return self.marks[name][occurrence]
        except (KeyError, IndexError):
            raise KeyError(f"no mark {name!r} #{occurrence}; marks: { {k: len(v) for k, v in self.marks.items()} }")

    def peak_during(self, start_ns: int, end_ns: int) -> int:
        """Max CPU "Total Allocated" from ``start_ns`` to ``end_ns`` (profiler clock), counting the level at start."""
        level = self.start_bytes
        peak = None
        for t, total, _ in self._memory:
            if t < start_ns:
                level = total
            elif t <= end_ns:
                peak = total if peak is None else max(peak, total)
        return level if peak is None else max(level, peak)

    def peak_between(self, start: str, end: str, occurrence: int = 0) -> int:
        """:meth:`peak_during` between the ``occurrence``-th calls of ``mark(start)`` and ``mark(end)``."""
        return self.peak_during(self._mark_ns(start, occurrence), self._mark_ns(end, occurrence))

    def collectives_between(self, start: str, end: str, occurrence: int = 0) -> list[dict[str, Any]]:
        """The collectives issued between the ``occurrence``-th calls of ``mark(start)`` and ``mark(end)``."""
        lo, hi = self._mark_ns(start, occurrence), self._mark_ns(end, occurrence)
        return [c for c, t in zip(self.collectives, self.collective_times_ns) if lo <= t <= hi]

    def memory_timeline(self) -> Iterator[tuple[int, int]]:
        """``(profiler ns, CPU total allocated)`` of every allocation event in the window."""
        return ((t, total) for t, total, _ in self._memory)
