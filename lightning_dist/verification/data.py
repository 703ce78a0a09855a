"""The reference's data: in each step, the samples the strategy's data-parallel ranks read together in that step.

The rule is one for every kind of loader: the reference's ranks together read the strategy's **global batch** (the
sum of the batch sizes its data-parallel ranks' loaders have, each counted once: tensor, context and pipeline peers
share one), through the loaders the user's hooks return in the reference's own process, **sampler included**.

- Lightning puts in the sampler (a plain ``DataLoader(dataset, batch_size=b)``): each rank of the strategy reads
  ``b`` samples of a ``DistributedSampler``'s order, the reference's hook returns ``b`` too; its batch becomes
  ``b × replicas / its ranks``, and Lightning gives it the same shuffled order.
- The user's own sampler built from ``trainer.strategy.distributed_sampler_kwargs``, with a per-rank batch of
  ``global // num_replicas``: in one process the hook already returns the global batch; nothing changes.
- A sampler that is not a ``DistributedSampler`` (or one that reads the world size itself) is kept as it is, only
  the batch size follows the rule.
- Where Lightning left the user's own sampler in place under the strategy (it leaves a ``DistributedSampler``, and
  any sampler with ``use_distributed_sampler=False``), the reference's loader keeps the user's too, even when the
  hook returns a plain loader in one process (``DistributedSampler(...) if num_replicas > 1 else None``), which
  Lightning would otherwise shuffle with a ``DistributedSampler`` of its own: its sampler is wrapped in
  :class:`UserOrder`, which Lightning leaves alone. Where Lightning replaced the sampler under the strategy, it
  replaces it in the reference too (the same shuffled order).

Whether the samples then agree is not assumed: both runs record a fingerprint of every training sample
(:func:`sample_fingerprints`), and :mod:`~lightning_dist.verification.compare` checks them step by step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from fractions import Fraction
from typing import Any

import torch
from lightning.pytorch.core.hooks import DataHooks
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

#: The loader hooks whose batches verify counts (the candidate) or sets (the reference).
HOOKS = {"train": "train_dataloader", "val": "val_dataloader"}
_BASE_HOOKS = (None, *(getattr(DataHooks, hook) for hook in HOOKS.values()))


class VerifyDataError(ValueError):
    """A data loader verify cannot give the reference with the strategy's global batch."""


def leaves(loaders: Any) -> list[Any]:
    """The loaders in ``loaders`` (one, or a list, tuple or dict of them as Lightning accepts), in order."""
    if isinstance(loaders, (list, tuple)):
        return [leaf for one in loaders for leaf in leaves(one)]
    if isinstance(loaders, dict):
        return [leaf for one in loaders.values() for leaf in leaves(one)]
    return [loaders]


def batch_size(loader: Any) -> int | None:
    """Samples per batch of ``loader`` (a ``DataLoader``, or its batch sampler's ``batch_size``); ``None``: unknown."""
    if not isinstance(loader, DataLoader):
        return None
    size = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    return size if isinstance(size, int) else None


def global_batches(ranks: list[tuple[int, list[int | None]]]) -> list[int | None]:
    """Per loader, the strategy's global batch from its ranks' ``(data-parallel rank, batch sizes)``: the sum over
    data-parallel ranks, each counted once (``None`` where a rank's is unknown)."""
    by_dp_rank = dict(ranks)  # peers of one data-parallel rank read the same loader
    count = max((len(sizes) for sizes in by_dp_rank.values()), default=0)
    totals: list[int | None] = []
    for index in range(count):
        sizes = [s[index] if index < len(s) else None for s in by_dp_rank.values()]
        totals.append(None if any(size is None for size in sizes) else sum(sizes))  # type: ignore[arg-type]
    return totals


def samplers_kept(returned: Any, used: Any) -> list[bool]:
    """Per loader, whether the loader Lightning runs (``used``) reads with the sampler of the one the user's hook
    returned (``returned``): Lightning did not put in a sampler of its own."""
    return [getattr(u, "sampler", None) is getattr(r, "sampler", None) for r, u in zip(leaves(returned), leaves(used))]


class UserOrder(DistributedSampler):
    """The user's own ``sampler``, read as it is, in a loader Lightning leaves alone (it leaves a
    ``DistributedSampler`` in place): the reference's loader where the strategy's ranks kept theirs."""

    def __init__(self, sampler: Any, dataset: Any) -> None:
        super().__init__(dataset, num_replicas=1, rank=0, shuffle=False)
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


def reference_loaders(
    loaders: Any, targets: list[int | None], ranks: int, same_ranks: bool, kept: list[bool] | None = None
) -> Any:
    """``loaders`` (the user's hook's return, in the reference) with each loader's batch set so that the reference's
    ``ranks`` ranks read its ``targets`` entry (the strategy's global batch) per step; ``same_ranks``: the strategy
    had as many data-parallel ranks, where a loader whose batch is unknown is right as it is. ``kept``: per loader,
    whether the strategy's ranks read it with the user's own sampler (then so does the reference)."""
    position = iter(range(len(leaves(loaders))))

    def each(one: Any) -> Any:
        if isinstance(one, (list, tuple)):
            return type(one)(each(x) for x in one)
        if isinstance(one, dict):
            return {key: each(x) for key, x in one.items()}
        index = next(position)
        keep = bool(kept and index < len(kept) and kept[index])
        return resized_loader(one, targets[index] if index < len(targets) else None, ranks, same_ranks, keep)

    return each(loaders)


def resized_loader(loader: Any, target: int | None, ranks: int, same_ranks: bool, keep_sampler: bool = False) -> Any:
    """``loader`` reading ``target`` samples per step over ``ranks`` ranks: itself when it already does, else a copy
    with the batch size changed and everything else (its sampler first) kept; ``keep_sampler``: with its sampler
    wrapped in :class:`UserOrder` so that Lightning does not replace it."""
    size = batch_size(loader)
    wrap = keep_sampler and isinstance(loader, DataLoader) and not isinstance(loader.sampler, DistributedSampler)
    wrap = wrap and loader.batch_size is not None and not isinstance(loader.dataset, IterableDataset)
    if size is not None and target is not None and size * ranks == target:
        return _copied(loader, size, UserOrder(loader.sampler, loader.dataset)) if wrap else loader
    if (size is None or target is None) and same_ranks:
        return loader  # the same loader code on as many data-parallel ranks reads the same batches
    if size is None or target is None or loader.batch_size is None:
        kind = type(loader).__name__
        raise VerifyDataError(
            f"verify needs DataLoaders with a batch_size to give the reference the strategy's global batch; got"
            f" {kind}{' with a custom batch_sampler' if isinstance(loader, DataLoader) else ''}."
            " Return a DataLoader(dataset, batch_size=...) from the *_dataloader hooks."
        )
    new = Fraction(target, ranks)
    if new.denominator != 1:
        raise VerifyDataError(
            f"The strategy's global batch of {target} samples per step cannot be split over the reference's {ranks}"
            " ranks. Choose a batch size or an --against with a number of ranks that divides it."
        )
    # the user's own sampler (a DistributedSampler, ...) or the default one Lightning replaces
    return _copied(loader, int(new), UserOrder(loader.sampler, loader.dataset) if wrap else loader.sampler)


def _copied(loader: DataLoader, size: int, sampler: Any) -> DataLoader:
    """A copy of ``loader`` with ``size`` samples per batch drawn by ``sampler``."""
    return DataLoader(
        loader.dataset,
        batch_size=size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
    )


def wrap_dataloader_hooks(owners: list[Any], change: Callable[[str, Any], Any]) -> None:
    """Make the ``train_dataloader`` and ``val_dataloader`` that Lightning calls return ``change(stage, loaders)``
    ("train" or "val"). Each hook is taken, as Lightning takes it, from the first of ``owners`` (the datamodule, then
    the module; ``None`` for none) whose class overrides it, and wrapped by an instance attribute there: a hook no
    class defines stays as it is (Lightning tells a defined hook from the base one by its code)."""
    for stage, hook in HOOKS.items():
        owner = next((o for o in owners if o is not None and getattr(type(o), hook, None) not in _BASE_HOOKS), None)
        if owner is not None:
            setattr(owner, hook, _wrapped(getattr(owner, hook), stage, change))


def _wrapped(method: Callable[[], Any], stage: str, change: Callable[[str, Any], Any]) -> Callable[[], Any]:
    def hook() -> Any:
        return change(stage, method())

    return hook


def sample_fingerprints(batch: Any) -> list[str] | None:
    """One short hash per sample of ``batch`` (a tensor, or a dict, list or tuple holding tensors that share their
    first dimension): the sample's row of every tensor, floating values as float64. ``None``: no such rows."""
    tensors = _tensors(batch)
    if not tensors or any(t.dim() == 0 or t.shape[0] != tensors[0].shape[0] for t in tensors):
        return None
    rows = [t.detach().to("cpu", torch.float64 if t.is_floating_point() else t.dtype).contiguous() for t in tensors]
    prints = []
    for index in range(tensors[0].shape[0]):
        digest = hashlib.blake2b(digest_size=8)
        for row in rows:
            digest.update(row[index].reshape(-1).view(torch.uint8).numpy().tobytes())
        prints.append(digest.hexdigest())
    return prints


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return [t for one in batch for t in _tensors(one)]
    return []
