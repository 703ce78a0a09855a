"""Capturing the ``self.log`` calls a step makes once per micro-batch on the loss stage, and logging them on every
pipeline rank: plain values combined over micro-batches as their ``reduce_fx`` says (sums summed, maxima and minima
taken, means averaged: the whole batch's value, as one process logs it), torchmetrics ``Metric`` objects with their
state copied from the loss stage (so every rank computes, syncs and logs the same value)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dist.compat.lightning import (
    compute_metric_locally,
    merge_metric_states,
    metric_cached_compute,
    metric_state_names,
    metric_step_value,
    metric_update_count,
    set_metric_step_value,
    set_metric_update_count,
)
from lightning_dist.strategies.lifecycle.logged_values import combine, log_options, log_replaced


@dataclass
class LoggedValue:
    """One ``self.log`` call: the name, the values of every micro-batch, and the call's other arguments."""

    name: str
    values: list[Any]
    args: tuple
    kwargs: dict[str, Any]

    @property
    def is_metric(self) -> bool:
        from torchmetrics import Metric

        return isinstance(self.values[-1], Metric)

    def combined(self) -> Tensor:
        """The whole batch's value from the micro-batches', by the call's ``reduce_fx`` (as one process computes it
        for the whole batch; a mean over equal micro-batches)."""
        values = [torch.as_tensor(v.detach() if isinstance(v, Tensor) else v) for v in self.values]
        dtype = torch.promote_types(values[0].dtype, torch.float32)
        reduce_fx = log_options(self.name, self.values[-1], self.args, self.kwargs)["reduce_fx"]
        return combine(torch.stack([v.to(dtype) for v in values]), reduce_fx)


@dataclass
class LogCapture:
    """The ``self.log`` calls of a step run once per micro-batch, by name, in first-call order."""

    logged: dict[str, LoggedValue] = field(default_factory=dict)

    def record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name in self.logged:
            self.logged[name].values.append(value)
        else:
            self.logged[name] = LoggedValue(name, [value], args, kwargs)

    @classmethod
    def merge(cls, captures: list[LogCapture]) -> LogCapture:
        """One capture holding the calls of ``captures`` in order (one capture per micro-batch)."""
        merged = cls()
        for capture in captures:
            for logged in capture.logged.values():
                for value in logged.values:
                    merged.record(logged.name, value, *logged.args, **logged.kwargs)
        return merged


@contextmanager
def captured_log(module: nn.Module, capture: LogCapture | None) -> Iterator[None]:
    """Inside the block ``module.log`` (and ``log_dict``, which calls it) records into ``capture`` (``None``:
    discards) instead of logging."""
    with log_replaced(module, capture.record if capture is not None else (lambda *a, **k: None)):
        yield


def share_logs(
    module: nn.Module,
    capture: LogCapture,
    loss: Tensor | None,
    group: Any,
    src: int,
    device: torch.device,
    mesh_groups: dict[str, Any],
) -> Tensor | None:
    """Log on every rank of ``group`` what the step logged on the rank ``src`` of ``group`` (the loss stage) and
    return ``loss`` from there.

    Plain values are combined over micro-batches (:meth:`LoggedValue.combined`) and sent; a logged torchmetrics ``Metric`` that is a submodule of
    ``module`` gets the loss stage's state (every rank holds the metric object, as metrics have no parameters), so
    Lightning's step value, epoch ``compute()`` and its sync over data-parallel peers agree on every rank. A
    ``sync_dist_group`` must be one of ``mesh_groups`` (the strategy's, by name): each stage syncs over its own.
    """
    holds = dist.get_rank(group) == src
    payload: list[Any] = [None]
    if holds:
        names = {id(m): n for n, m in module.named_modules()}
        logs = [
            (v.name, v.combined().cpu(), v.args, _named_groups(v, mesh_groups))
            for v in capture.logged.values()
            if not v.is_metric
        ]
        metrics = [
            (v.name, names.get(id(v.values[-1])), _metric_state(v.values[-1]), v.args, _named_groups(v, mesh_groups))
            for v in capture.logged.values()
            if v.is_metric
        ]
        payload = [(None if loss is None else loss.detach().cpu(), logs, metrics)]
    dist.broadcast_object_list(payload, group=group, group_src=src)
    shared_loss, logs, metrics = payload[0]
    for name, value, args, kwargs in logs:
        module.log(name, value.to(device), *args, **_own_groups(kwargs, mesh_groups))
    for name, path, state, args, kwargs in metrics:
        if holds:
            module.log(name, capture.logged[name].values[-1], *args, **_own_groups(kwargs, mesh_groups))
        elif path is not None:  # a metric outside the module tree is logged on the loss stage only
            metric = module.get_submodule(path)
            _set_metric_state(metric, state, device)
            module.log(name, metric, *args, **_own_groups(kwargs, mesh_groups))
    return None if shared_loss is None else shared_loss.to(device)


class _MeshGroup(str):
    """A ``sync_dist_group`` sent to the other stages by its name in the mesh: each rank syncs over its own."""


def _named_groups(logged: LoggedValue, mesh_groups: dict[str, Any]) -> dict[str, Any]:
    """The call's keyword arguments with a ``sync_dist_group`` (a process group, which cannot be sent) replaced by the
    name of the strategy's mesh group with the same ranks."""
    group = logged.kwargs.get("sync_dist_group")
    if group is None:
        return logged.kwargs
    ranks = dist.get_process_group_ranks(group)
    name = next((n for n, g in mesh_groups.items() if dist.get_process_group_ranks(g) == ranks), None)
    if name is None:
        raise ValueError(
            f"self.log({logged.name!r}, ..., sync_dist_group=<a group of ranks {ranks}>): under a pipeline the value"
            " is logged on every stage, each syncing over its own stage's ranks, so the group must be one of the"
            " strategy's: trainer.strategy.data_parallel_group, or trainer.strategy.process_group(name) with a name"
            f" among {sorted(mesh_groups)}. Leave sync_dist_group out to sync over the data-parallel and"
            " context-parallel ranks."
        )
    return {**logged.kwargs, "sync_dist_group": _MeshGroup(name)}


def _own_groups(kwargs: dict[str, Any], mesh_groups: dict[str, Any]) -> dict[str, Any]:
    group = kwargs.get("sync_dist_group")
    return {**kwargs, "sync_dist_group": mesh_groups[group]} if isinstance(group, _MeshGroup) else kwargs


def _metric_state(metric: Any) -> dict[str, Any]:
    state = {k: _to_cpu(getattr(metric, k)) for k in metric_state_names(metric)}
    return {"state": state, "count": metric_update_count(metric), "cache": _to_cpu(metric_step_value(metric))}


def _set_metric_state(metric: Any, payload: dict[str, Any], device: torch.device) -> None:
    for key, value in payload["state"].items():
        setattr(metric, key, _to_device(value, device))
    set_metric_update_count(metric, payload["count"])
    set_metric_step_value(metric, _to_device(payload["cache"], device))


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value


class MetricSteps:
    """Keeps the torchmetrics ``Metric`` submodules of ``module`` out of the per-micro-batch calls of a step and adds
    what the step's real micro-batches updated once, after the step.

    torch's first schedule step also calls the loss function on placeholder values (to infer shapes); a metric updated
    there would count samples one process never sees. Each call therefore starts from a reset metric and its state
    (the micro-batch's own) is kept aside; :meth:`finish` merges the kept states of the real calls, sets the step value
    (``_forward_cache``) to the metric computed on all of them, as one process computes it on the whole batch, and adds
    them to the metric's state from before the step.
    """

    def __init__(self, module: nn.Module) -> None:
        from torchmetrics import Metric

        self.metrics = [m for m in module.modules() if isinstance(m, Metric)]
        self.calls: list[list[dict[str, Any] | None]] = []

    @contextmanager
    def call(self) -> Iterator[None]:
        """One micro-batch's call: the metrics start reset and end as before; their updates are kept aside."""
        saved = [_snapshot(m) for m in self.metrics]
        for metric in self.metrics:
            metric.reset()
        try:
            yield
            self.calls.append([_states(m) if metric_update_count(m) else None for m in self.metrics])
        finally:
            for metric, state in zip(self.metrics, saved):
                _restore(metric, state)

    def finish(self, n_real: int) -> None:
        """Add the last ``n_real`` calls' updates to the metrics (earlier calls were torch's shape inference)."""
        real = self.calls[len(self.calls) - n_real :] if n_real else []
        for i, metric in enumerate(self.metrics):
            deltas = [c[i] for c in real if c[i] is not None]
            if not deltas:
                continue
            before = _snapshot(metric)
            merged: dict[str, Any] | None = None
            for count, delta in enumerate(deltas, 1):
                _set_states(metric, delta)
                set_metric_update_count(metric, count)
                if merged is not None:
                    merge_metric_states(metric, merged)
                merged = _states(metric)
            value = compute_metric_locally(metric)  # the loss stage alone runs this: no collective
            set_metric_update_count(metric, before["count"] + 1)
            if before["count"]:
                merge_metric_states(metric, before["state"])
            set_metric_step_value(metric, value)
        self.calls = []


def _states(metric: Any) -> dict[str, Any]:
    return {k: _copy(getattr(metric, k)) for k in metric_state_names(metric)}


def _set_states(metric: Any, states: dict[str, Any]) -> None:
    for key, value in states.items():
        setattr(metric, key, _copy(value))


def _snapshot(metric: Any) -> dict[str, Any]:
    return {
        "state": _states(metric),
        "count": metric_update_count(metric),
        "cache": metric_step_value(metric),
        "computed": metric_cached_compute(metric),
    }


def _restore(metric: Any, snapshot: dict[str, Any]) -> None:
    _set_states(metric, snapshot["state"])
    set_metric_update_count(metric, snapshot["count"])
    set_metric_step_value(metric, snapshot["cache"], snapshot["computed"])


def _copy(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
