"""The live bytes of a rank's tensors through a step, and their peak split by what the memory holds.

:class:`LiveMemory` is a dispatch mode: every tensor an op returns is followed by its storage (a view or an in-place
result adds nothing) until the storage is freed, and ``UntypedStorage.resize_`` (how FSDP2 frees and re-allocates
the unsharded parameters between forward and backward) is counted. It works on real and on fake tensors: a dry run
measures a step that allocates nothing. The state a step starts with (parameters, buffers, gradients, optimizer
states) is counted from the start. Tensors on the meta device hold no memory and are not counted, nor are the fake
tensors of the global shape DTensor makes to find an op's output shape (its sharding propagation).

A step that creates the optimizer's states (a run's first) peaks lower than the steps after it, whose forward and
backward run with those states alive: :meth:`LiveMemory.mark_update` (called where the optimizer update begins)
lets :meth:`LiveMemory.peak_split` answer for a later step from the first: the peak before the update, plus the
optimizer states, when that is higher.

At the peak it remembers which storages were alive; :meth:`LiveMemory.peak_split` names them afterwards from the
modules and optimizers it was given: ``parameters`` (shards, and the unsharded copies FSDP2 gathers and frees by
resizing), ``buffers``, ``gradients``, ``optimizer`` (states), and ``activations`` (everything else: activations
saved for backward and temporaries). Storage sizes are what tensors hold; an allocator's rounding and caching (CUDA's
``max_memory_reserved``) come on top.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from typing_extensions import Self

from lightning_dist.compat import (
    TorchDispatchMode,
    dtensor_shape_propagation,
    metadata_ops,
    storage_identity,
    untyped_storage_identity,
)

_METADATA_OPS = metadata_ops()
CATEGORIES = ("parameters", "buffers", "gradients", "optimizer", "activations")


class LiveMemory(TorchDispatchMode):
    """``with LiveMemory(modules, optimizers) as memory: step()``, then ``memory.peak`` and ``memory.peak_split()``."""

    def __init__(self, modules: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        super().__init__()
        self.modules = list(modules)
        self.optimizers = list(optimizers)
        self.current = 0
        self.peak = 0
        # by storage (its address, which a later storage may reuse): bytes, and a serial number unique to it
        self._bytes: dict[int, int] = {}
        self._serial: dict[int, int] = {}
        self._serials = 0
        self._at_peak: dict[int, int] = {}  # serial -> bytes
        self._peak_unrecorded = False  # the peak was reached and nothing freed since: `_at_peak` is still to copy
        self._resized: set[int] = set()  # serials
        self._original_resize: Any = None
        self._original_propagation: Any = None
        self._propagating = 0
        self._before_update: tuple[int, dict[int, int]] | None = None

    def __enter__(self) -> Self:
        for tensor in self._state_tensors():
            self._follow(tensor)
        self._note_peak()
        self._original_resize = torch.UntypedStorage.resize_
        memory, original = self, self._original_resize

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            result = original(storage, size)
            memory._resize(storage, size)
            return result

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        owner, name = dtensor_shape_propagation()
        self._original_propagation = propagate = getattr(owner, name)

        def propagation(*args: Any, **kwargs: Any) -> Any:
            memory._propagating += 1
            try:
                return propagate(*args, **kwargs)
            finally:
                memory._propagating -= 1

        setattr(owner, name, propagation)
        super().__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        super().__exit__(*exc_info)
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        owner, name = dtensor_shape_propagation()
        setattr(owner, name, self._original_propagation)

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        if func in _METADATA_OPS:
            return func(*args, **(kwargs or {}))
        if any(_is_wrapper(t) for t in types):
            return NotImplemented  # a DTensor desugars into ops on its local tensors, which come back here
        out = func(*args, **(kwargs or {}))
        if self._propagating:
            return out
        for leaf in tensors_in(out):
            self._follow(leaf)
        return out

    def mark_update(self) -> None:
        """The optimizer update begins (forward and backward are done): remember the peak so far."""
        self._record_peak()
        if self._before_update is None:
            self._before_update = (self.peak, dict(self._at_peak))

    def peak_split(self, later_step: bool = False) -> dict[str, int]:
        """Bytes alive at the peak by category (see the module docstring), and ``"total"``. ``later_step``: the peak
        of a step after this one, whose forward and backward run with the optimizer states this one made (needs
        :meth:`mark_update`)."""
        self._record_peak()
        kinds = self._kinds()
        split = self._split(self._at_peak, kinds, self.peak)
        if later_step and self._before_update is not None:
            peak, alive = self._before_update
            states = sum(size for serial, size in self._current_serials() if kinds.get(serial) == "optimizer")
            before = self._split(alive, kinds, peak)
            if before["total"] + states - before["optimizer"] > split["total"]:
                before["total"] += states - before["optimizer"]
                before["optimizer"] = states
                return before
        return split

    def _current_serials(self) -> Iterator[tuple[int, int]]:
        for key, size in self._bytes.items():
            yield self._serial[key], size

    def _split(self, alive: dict[int, int], kinds: dict[int, str], total: int) -> dict[str, int]:
        split = dict.fromkeys(CATEGORIES, 0)
        for serial, size in alive.items():
            split[kinds.get(serial, "activations")] += size
        split["total"] = total
        return split

    def _kinds(self) -> dict[int, str]:
        kinds: dict[int, str] = {serial: "parameters" for serial in self._resized}
        for kind, tensors in self._state_by_kind():
            for tensor in tensors:
                for inner in _storage_tensors(tensor):
                    serial = self._serial.get(storage_identity(inner))
                    if serial is not None:
                        kinds.setdefault(serial, kind)
        return kinds

    # -------------------------------------------------------------------------------------------------- bookkeeping
    def _follow(self, tensor: torch.Tensor) -> None:
        for inner in _storage_tensors(tensor):
            if inner.device.type == "meta":  # shapes only: DTensor's sharding propagation works on these
                continue
            storage = inner.untyped_storage()
            key = storage_identity(inner)
            if key in self._bytes:
                continue
            self._track(key, storage.nbytes())
            weakref.finalize(storage, self._free, key)
            self._note_peak()

    def _resize(self, storage: torch.UntypedStorage, size: int) -> None:
        key = untyped_storage_identity(storage)
        if key not in self._bytes:
            self._track(key, 0)
            weakref.finalize(storage, self._free, key)
        if size < self._bytes[key]:
            self._record_peak()
        self.current += size - self._bytes[key]
        self._bytes[key] = size
        self._resized.add(self._serial[key])
        self._note_peak()

    def _track(self, key: int, size: int) -> None:
        self._bytes[key] = size
        self._serials += 1
        self._serial[key] = self._serials
        self.current += size

    def _free(self, key: int) -> None:
        self._record_peak()
        self.current -= self._bytes.pop(key, 0)
        self._serial.pop(key, None)

    def _note_peak(self) -> None:
        if self.current > self.peak or not self._at_peak:
            self.peak = max(self.peak, self.current)
            self._peak_unrecorded = True

    def _record_peak(self) -> None:
        # copied when the memory first goes down after a peak, not at each allocation that raises it: a step's
        # rising forward would copy thousands of entries per op
        if self._peak_unrecorded:
            self._peak_unrecorded = False
            self._at_peak = {self._serial[key]: size for key, size in self._bytes.items()}

    def _state_by_kind(self) -> Iterator[tuple[str, Iterable[torch.Tensor]]]:
        yield "parameters", (p for m in self.modules for p in m.parameters())
        yield "buffers", (b for m in self.modules for b in m.buffers())
        yield "gradients", (p.grad for m in self.modules for p in m.parameters() if p.grad is not None)
        yield (
            "optimizer",
            (
                value
                for optimizer in self.optimizers
                for state in optimizer.state.values()
                for value in state.values()
                if isinstance(value, torch.Tensor)
            ),
        )

    def _state_tensors(self) -> Iterator[torch.Tensor]:
        for _, tensors in self._state_by_kind():
            yield from tensors


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (tuples, lists and dicts of them, nested)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def _is_wrapper(cls: type) -> bool:
    return hasattr(cls, "__tensor_flatten__")


def _storage_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that own storage behind ``tensor`` (a DTensor's local tensor; the tensor itself otherwise)."""
    if _is_wrapper(type(tensor)):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):
                yield from _storage_tensors(inner)
    else:
        yield tensor
