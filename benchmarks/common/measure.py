"""Measurements taken inside a rank: timing statistics, activation and process memory, communication aggregation.

Timing is only ever reported as a ratio of two configurations measured in the same invocation, with repeats
interleaved (A B A B ...): on a shared 2-core machine absolute times drift, ratios of interleaved medians much less.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from lightning_dist.profiling import CommRecord

# ---------------------------------------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    """Wait for queued device work so that a host timestamp covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Per-step wall times and process CPU times: call :meth:`start` when a step begins and :meth:`stop` when it ends.

    The CPU time (``time.process_time``: every thread of this process, the process group's included) leaves out the
    time a rank waits for its peers or for a free core, so on a shared or oversubscribed host it measures the work a
    step does more steadily than wall time; wall time is what a user waits for.

    Args:
        device: Device whose queued work each timestamp waits for.
        warmup: Leading steps that are timed but excluded from :attr:`times`.
    """

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device = device
        self.warmup = warmup
        self.all_times: list[float] = []
        self.all_cpu_times: list[float] = []
        self._t0: float | None = None
        self._c0 = 0.0

    def start(self) -> None:
        sync(self.device)
        self._t0 = time.perf_counter()
        self._c0 = time.process_time()

    def stop(self) -> None:
        assert self._t0 is not None, "StepTimer.stop() without start()"
        sync(self.device)
        self.all_times.append(time.perf_counter() - self._t0)
        self.all_cpu_times.append(time.process_time() - self._c0)
        self._t0 = None

    @property
    def times(self) -> list[float]:
        """Step times after the warm-up steps, in seconds."""
        return self.all_times[self.warmup :]

    @property
    def cpu_times(self) -> list[float]:
        """Process CPU seconds per step after the warm-up steps."""
        return self.all_cpu_times[self.warmup :]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and interquartile range (inclusive quartiles) of ``values``."""
    if not values:
        raise ValueError("spread() of no values")
    vals = sorted(values)
    if len(vals) >= 2:
        q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    else:
        q1 = q3 = vals[0]
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "q1": q1, "q3": q3, "n": len(vals)}


def ratio_stats(ours: Sequence[float], baseline: Sequence[float]) -> dict[str, float]:
    """Compare two interleaved series of per-repeat values (repeat ``i`` of each ran back to back).

    Returns:
        ``ratio_of_medians`` = median(ours) / median(baseline) (the headline figure), and the median, min and max of
        the per-repeat ratios ``ours[i] / baseline[i]`` (its spread).
    """
    if not ours or len(ours) != len(baseline):
        raise ValueError(f"need two equally long, non-empty series, got {len(ours)} and {len(baseline)}")
    pairs = [a / b for a, b in zip(ours, baseline)]
    return {
        "ratio_of_medians": statistics.median(ours) / statistics.median(baseline),
        "pair_median": statistics.median(pairs),
        "pair_min": min(pairs),
        "pair_max": max(pairs),
        "n": len(pairs),
    }


def interleaved_order(names: Sequence[str], repeat: int) -> list[str]:
    """Order of the configurations in repeat ``repeat``: rotated by one each repeat so that no configuration always
    runs first (after a cooler CPU) or last."""
    k = repeat % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


# ---------------------------------------------------------------------------------------------------------- memory


def _storage_key(t: torch.Tensor) -> tuple[Any, int]:
    if hasattr(t, "to_local"):
        t = t.to_local()
    try:
        storage = t.untyped_storage()
        return (t.device, storage.data_ptr()) if storage.data_ptr() else ("id", id(t)), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return ("id", id(t)), t.numel() * t.element_size()


class ActivationCounter:
    """Bytes of activations a training step keeps for backward: the distinct storages autograd saves while the
    counter is active, excluding storages of the model's parameters (a saved ``weight.t()`` is a view of a
    parameter, not an activation; FSDP2's unsharded parameters are the module's parameters during forward).

    With activation checkpointing (non-reentrant, as ``torch.distributed._composable.checkpoint`` and
    ``torch.utils.checkpoint(use_reentrant=False)`` are) the tensors saved *inside* a checkpointed block go to the
    checkpoint's own saved-tensor hooks, which take precedence, and never reach this counter; the block inputs the
    checkpoint keeps to recompute from are saved through autograd outside the block, and are counted.

    Args:
        model: The module whose parameters are not counted.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._seen: set[Any] = set()
        self._param_keys: set[Any] = set()
        self.saved_bytes = 0
        self._ctx: Any = None

    def _refresh_param_keys(self) -> None:
        self._param_keys = {_storage_key(p)[0] for p in self._model.parameters()}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key, nbytes = _storage_key(t)
        if key in self._seen:
            return t
        if key in self._param_keys:
            return t
        self._refresh_param_keys()  # parameters may have been swapped since (FSDP2 unshards them per module)
        if key not in self._param_keys:
            self._seen.add(key)
            self.saved_bytes += nbytes
        return t

    def __enter__(self) -> Self:
        self._refresh_param_keys()
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_bytes() -> int | None:
    """Current resident set size (Linux ``VmRSS``), or ``None`` where unavailable."""
    kib = _proc_status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """Peak resident set size since the last :func:`reset_peak_rss` (Linux ``VmHWM``), or ``None``."""
    kib = _proc_status_kib("VmHWM")
    return None if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Return freed heap to the OS (glibc ``malloc_trim``) and reset the peak RSS (``/proc/self/clear_refs`` = 5).

    Returns:
        Whether the peak could be reset (Linux only).
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------------- communication


def group_label(record: CommRecord) -> str:
    """Name of the process group of a record: its size and global ranks, e.g. ``"4:[0,1,2,3]"``."""
    ranks = ",".join(map(str, record.group_ranks)) if record.group_ranks else "?"
    return f"{record.group_size}:[{ranks}]"


def comm_breakdown(records: Iterable[CommRecord]) -> list[dict[str, Any]]:
    """Aggregate records by (collective, group, phase, dtype): count and byte totals, sorted by sent bytes."""
    table: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for r in records:
        key = (r.op, group_label(r), r.phase, str(r.dtype).removeprefix("torch."))
        row = table.setdefault(
            key,
            {
                "op": key[0],
                "group": key[1],
                "phase": key[2],
                "dtype": key[3],
                "count": 0,
                "tensor_bytes": 0,
                "sent_bytes": 0,
                "cross_node_bytes": 0,
            },
        )
        row["count"] += 1
        row["tensor_bytes"] += r.tensor_bytes
        row["sent_bytes"] += r.sent_bytes
        row["cross_node_bytes"] += r.cross_node_bytes
    return sorted(table.values(), key=lambda row: (-row["sent_bytes"], row["op"], row["group"], row["phase"]))


def comm_totals(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Sum of ``count`` and byte fields over :func:`comm_breakdown` rows."""
    out = {"count": 0, "tensor_bytes": 0, "sent_bytes": 0, "cross_node_bytes": 0}
    for row in rows:
        for k in out:
            out[k] += row[k]
    return out
