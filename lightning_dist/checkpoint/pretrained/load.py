"""Loading pretrained safetensors weights into a model, sharded or not, through torch DCP's
``HuggingFaceStorageReader``: each rank reads only the slices its DTensor shards hold, and each value is converted to
the dtype of the tensor it lands in (a bf16 file into fp32 parameters).

The model's state is taken as a checkpoint takes it (``get_model_state_dict``: a tensor-parallel fused projection in
its original row order, a pipeline stage's keys only, FP8 wrappers removed), loaded in place by DCP, and set back
with ``set_model_state_dict`` (which permutes the fused rows again). Names are matched and every problem refused
before any tensor is read (:mod:`.matching`); with a process group, the ranks join their matches (a pipeline's
stages each hold part of the keys) and all raise the same error. Every rank of the group must call
:func:`load_pretrained` (DCP agrees on a plan collectively).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, load
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.futures import Future

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.pretrained.adapters import AdapterLayout, adapter_layout, unsupported_adapters
from lightning_dist.checkpoint.pretrained.files import PretrainedFiles, read_pretrained_files
from lightning_dist.checkpoint.pretrained.matching import SHOWN, KeyMatch, match_keys, refuse_problems
from lightning_dist.checkpoint.pretrained.stacked import read_stacked
from lightning_dist.compat import local_region, non_persistent_buffer_names
from lightning_dist.compat.hugging_face import checkpoint_conversions
from lightning_dist.compat.torchao import plain_state
from lightning_dist.progress import Progress


@dataclass(frozen=True)
class PretrainedLoad:
    """What :func:`load_pretrained` did: the prefix of the pretrained submodule, how many tensors this rank loaded,
    the tied names loaded through another name, the model's state outside the prefix that it left as it was, and the
    LoRA adapters' own tensors, which keep their initialization."""

    path: Path
    prefix: str
    loaded: int
    tied: dict[str, tuple[str, ...]]
    outside_prefix: tuple[str, ...]
    adapters: tuple[str, ...] = ()


def load_pretrained(
    model: nn.Module,
    path: str | os.PathLike,
    prefix: str | None = None,
    aliases: Mapping[str, Sequence[str]] | None = None,
    progress: bool = False,
    threads: int | None = None,
) -> PretrainedLoad:
    """Load the weights at ``path`` (a Hugging Face folder, one ``*.safetensors`` file, a litgpt folder's
    ``lit_model.pth`` or another ``torch.save`` state dict) into ``model``'s
    parameters and persistent buffers in place, DTensor shards included; a LoRA-wrapped layer's base weight is read
    under the unwrapped layer's name, and the adapters keep their own values (:mod:`.adapters`). ``progress``: show
    the bytes this rank reads on stderr (:mod:`lightning_dist.progress`; rank 0's, as the strategies show it). ``prefix``: the name of the submodule that
    holds the pretrained model, with its dot (``"model."``); found from the names when ``None``. ``aliases``: state key
    → other names the file may hold the same weight under (a pipeline stage's copy of a tied weight). ``threads``:
    how many tensors of a safetensors folder are read at once (:func:`read_threads` when ``None``), within the
    memory of one read of the largest.

    Raises :class:`~lightning_dist.checkpoint.CheckpointError` on every rank before reading any tensor when the
    files do not fit the model; the model must be materialized (no meta tensors)."""
    files = read_pretrained_files(path)
    refuse_unsupported_adapters(model, files)
    layout = adapter_layout(model)
    full_state = plain_state(get_model_state_dict(model))
    state = layout.unwrapped(full_state)  # a LoRA-wrapped layer's base weight under the unwrapped model's name
    renamings, stackings = checkpoint_conversions(model)
    match = match_keys(
        state, files, prefix, _unwrapped_aliases(aliases or {}, layout), _unwrapped_names(transient_names(model), layout),
        _unwrapped_ties(model, layout), False, renamings, stackings,
    )  # fmt: skip
    distributed = dist.is_available() and dist.is_initialized()
    refuse_problems(files, _all_ranks(match) if distributed else [match])
    total = sum(_local(target).numel() * files.tensors[key].dtype.itemsize for key, target in match.targets.items())
    with Progress(total, "initial_weights", quiet=not progress) as shown:
        if files.mapped is None:
            reader = _reader(files, shown, threads if threads is not None else read_threads())
            load(dict(match.targets), storage_reader=reader, no_dist=not distributed)
        else:  # a torch.save file, memory-mapped: each rank copies its slices, touching only their pages
            for key, target in match.targets.items():
                _copy_value(target, files.mapped[key])
                shown.update(_local(target).numel() * files.tensors[key].dtype.itemsize)
    for key, source in match.stacked.items():  # stacked experts: each rank reads its experts' pieces itself
        read_stacked(state[key], source, files)
    for key, file_key in match.copies.items():
        _copy_value(state[key], match.targets[file_key])
    set_model_state_dict(model, full_state, options=StateDictOptions(strict=True))
    loaded = len(match.targets) + len(match.stacked)
    adapters = tuple(layout.adapter_names(full_state))
    return PretrainedLoad(files.path, match.prefix, loaded, match.tied, match.outside_prefix, adapters)


def check_pretrained_fit(model: nn.Module, path: str | os.PathLike, prefix: str | None = None) -> str:
    """Before launch, on the whole (unsharded, possibly meta-device) model: raise the
    :class:`~lightning_dist.checkpoint.CheckpointError` that :func:`load_pretrained` would, reading headers only.
    Returns the prefix found."""
    files = read_pretrained_files(path)
    refuse_unsupported_adapters(model, files)
    layout = adapter_layout(model)
    renamings, stackings = checkpoint_conversions(model)
    state = layout.unwrapped(model.state_dict())
    match = match_keys(
        state, files, prefix, None, _unwrapped_names(transient_names(model), layout),
        _unwrapped_ties(model, layout), True, renamings, stackings,
    )  # fmt: skip
    refuse_problems(files, [match])
    return match.prefix


def refuse_unsupported_adapters(model: nn.Module, files: PretrainedFiles) -> None:
    """Raise a :class:`CheckpointError` naming the adapter layers of ``model`` that pretrained weights read after
    the model was built cannot serve (:func:`~.adapters.unsupported_adapters`)."""
    lines = unsupported_adapters(model)
    if lines:
        raise CheckpointError(
            f"Pretrained weights {str(files.path)!r} cannot be read into this model after it was built:"
            f" {len(lines)} adapter layers depend on the base weights or are not LoRA's:\n- "
            + "\n- ".join(lines[:SHOWN])
            + (f"\n- (and {len(lines) - SHOWN} more)" if len(lines) > SHOWN else "")
            + "\nUse plain LoRA (peft.LoraConfig with the default init_lora_weights, no DoRA, no modules_to_save),"
            " or build the model with from_pretrained and then get_peft_model in the module's __init__ (without"
            " initial_weights)."
        )


def transient_names(model: nn.Module) -> set[str]:
    """The qualified names of the model's non-persistent buffers (in no state dict, so in no checkpoint)."""
    return {
        f"{path}.{name}" if path else name
        for path, module in model.named_modules(remove_duplicate=False)
        for name in non_persistent_buffer_names(module)
    }


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter or buffer the model registered under several (GPT-2's embedding and head)."""
    by_tensor: dict[int, list[str]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        by_tensor.setdefault(id(tensor), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def _unwrapped_names(names: set[str], layout: AdapterLayout) -> set[str]:
    return set(layout.file_names(names).values())


def _unwrapped_ties(model: nn.Module, layout: AdapterLayout) -> list[list[str]]:
    return [[layout.split(name)[0] for name in names] for names in tied_names(model)]


def _unwrapped_aliases(aliases: Mapping[str, Sequence[str]], layout: AdapterLayout) -> dict[str, tuple[str, ...]]:
    return {layout.split(key)[0]: tuple(layout.split(name)[0] for name in names) for key, names in aliases.items()}


def _all_ranks(match: KeyMatch) -> list[KeyMatch]:
    """Every rank's match (without its tensors), so that all ranks judge the same problems."""
    mine = KeyMatch(match.prefix, {}, {}, {}, (), match.used, match.skipped, {}, match.problems)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _copy_value(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target`` ← ``source``'s value, whatever the two layouts (a tied weight's copies on one rank; a whole,
    memory-mapped tensor into this rank's block: only that block is read, on the CPU)."""
    with torch.no_grad():
        if isinstance(source, DTensor) and isinstance(target, DTensor) and source.placements == target.placements:
            target.to_local().copy_(source.to_local())
            return
        full = source.full_tensor() if isinstance(source, DTensor) else source
        if not isinstance(target, DTensor):
            target.copy_(full)
            return
        try:
            offsets, shape = local_region(target)
            block = full[tuple(slice(offset, offset + size) for offset, size in zip(offsets, shape))]
        except ValueError:  # not one block (a strided shard): cut it as DTensor does
            full = full.to(target.device)
            block = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(block)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _reader(files: PretrainedFiles, progress: Progress, threads: int) -> HuggingFaceStorageReader:
    folder = files.path if files.path.is_dir() else files.path.parent
    return _ListedFilesReader(folder, files.files, progress, threads)


class _ListedFiles(FileSystem):
    """A file system whose folder listing is the given files: DCP's reader reads every ``*.safetensors`` it lists."""

    def __init__(self, files: tuple[Path, ...]) -> None:
        super().__init__()
        self.files = [str(file.absolute()) for file in files]

    def ls(self, path: str | os.PathLike) -> list[str]:
        return list(self.files)


class _ListedFilesReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` reading only the files of the index (or the one file given), not every
    ``*.safetensors`` file beside them, and mapping a file for one tensor at a time: torch's keeps a file mapped
    while it serves all of a rank's reads from it, and every page touched stays resident until then (0.15 GiB of a
    4-rank load of a 2 GB model; up to the rank's share of a whole 5 GB shard).

    Several tensors are read at once (``threads``: :func:`read_threads`), within a budget of bytes in flight equal to the
    largest single read: many small tensors overlap their reads, the largest is read alone, and the rank never holds
    more transient bytes than one serial read of its largest tensor did (the memory bound of docs/pretrained.md)."""

    def __init__(self, folder: Path, files: tuple[Path, ...], progress: Progress, threads: int = 1) -> None:
        super().__init__(str(folder))
        self.fs = _ListedFiles(files)
        self.progress = progress
        self.threads = threads
        self._lock = threading.Lock()  # DCP's planner and the progress display are not made for threads

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        sizes = [_nbytes(planner.resolve_tensor(item)) for item in plan.items]
        budget = _ByteBudget(max(sizes, default=0))
        threads = self.threads
        if threads == 1 or len(plan.items) < 2:
            for item in plan.items:
                self._read(item, planner)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="lightning_dist-initial_weights") as pool:
                futures = []
                for item, size in zip(plan.items, sizes):
                    budget.acquire(size)
                    futures.append(pool.submit(self._read_within, item, planner, budget, size))
                for future in futures:
                    future.result()  # the first failure, raised here
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_within(self, item: Any, planner: LoadPlanner, budget: _ByteBudget, size: int) -> None:
        try:
            self._read(item, planner)
        finally:
            budget.release(size)

    def _read(self, item: Any, planner: LoadPlanner) -> None:
        from safetensors import safe_open

        with safe_open(self.storage_data[item.storage_index].relative_path, framework="pt") as file:
            values = file.get_slice(item.storage_index.fqn)[
                tuple(slice(offset, offset + size) for offset, size in zip(item.storage_offsets, item.lengths))
            ]
            target = planner.resolve_tensor(item).detach()
            if target.size() != values.size():
                raise CheckpointError(
                    f"{item.storage_index.fqn}: read {list(values.size())} for a slot of {list(target.size())}"
                )
            target.copy_(values)
            with self._lock:
                planner.commit_tensor(item, target)
                self.progress.update(values.nbytes)


class _ByteBudget:
    """At most ``limit`` bytes of reads in flight; a read larger than the limit waits until nothing else is read."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._changed = threading.Condition()

    def acquire(self, size: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.in_flight == 0 or self.in_flight + size <= self.limit)
            self.in_flight += size

    def release(self, size: int) -> None:
        with self._changed:
            self.in_flight -= size
            self._changed.notify_all()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def read_threads(local_ranks: int | None = None) -> int:
    """Threads reading pretrained tensors on this rank: the processors this process may use shared by the ranks on
    its node (``local_ranks``, else torchrun's ``LOCAL_WORLD_SIZE``, else 1), at most 8, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(8, cores // max(local_ranks, 1)))
