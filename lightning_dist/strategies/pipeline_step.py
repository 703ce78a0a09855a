"""Pure helpers of the pipeline strategy's steps: slicing a batch into micro-batches, capturing ``self.log`` calls
made per micro-batch, averaging them, and putting per-micro-batch outputs back in batch order."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


def slice_batch(batch: Any, start: int, stop: int, batch_size: int) -> Any:
    """Rows ``start:stop`` of every tensor (dim 0 of size ``batch_size``) and list/tuple of ``batch_size`` items in
    ``batch``, recursively through dicts, lists and tuples; everything else is kept whole."""
    if isinstance(batch, Tensor):
        return batch[start:stop] if batch.dim() > 0 and batch.shape[0] == batch_size else batch
    if isinstance(batch, dict):
        return type(batch)({k: slice_batch(v, start, stop, batch_size) for k, v in batch.items()})
    if isinstance(batch, (list, tuple)):
        if len(batch) == batch_size and not any(isinstance(v, (Tensor, dict, list, tuple)) for v in batch):
            return batch[start:stop]
        items = [slice_batch(v, start, stop, batch_size) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


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

    def mean(self) -> Tensor:
        """The mean over micro-batches (as one process computes it for the whole batch of equal micro-batches)."""
        values = [torch.as_tensor(v.detach() if isinstance(v, Tensor) else v) for v in self.values]
        dtype = torch.promote_types(values[0].dtype, torch.float32)
        return torch.stack([v.to(dtype) for v in values]).mean(0)


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
    previous = module.__dict__.get("log")
    module.log = capture.record if capture is not None else (lambda *a, **k: None)
    try:
        yield
    finally:
        if previous is None:
            del module.log
        else:
            module.log = previous


def join_outputs(outputs: list[Any]) -> Any:
    """Per-micro-batch outputs of ``predict_step`` back in batch order: tensors concatenated along dim 0 (also
    inside dicts, lists and tuples); otherwise the list of outputs."""
    first = outputs[0] if outputs else None
    if isinstance(first, Tensor) and first.dim() > 0:
        return torch.cat(outputs)
    if isinstance(first, dict):
        return type(first)({k: join_outputs([o[k] for o in outputs]) for k in first})
    if isinstance(first, (list, tuple)) and not hasattr(first, "_fields"):
        return type(first)(join_outputs([o[i] for o in outputs]) for i in range(len(first)))
    return outputs
