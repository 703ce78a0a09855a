"""The reference's data: the strategy's global batch, read by fewer ranks.

Under a strategy, each of the ``replicas`` data-parallel ranks reads ``batch_size`` samples per step, through the
``DistributedSampler`` Lightning puts in (it shuffles a training loader with the global seed even when the loader
says ``shuffle=False``). The reference is run with Lightning's DDP on its own ranks (one, by default), so Lightning
puts in the same sampler with the same seed; only the batch size changes, to ``batch_size × replicas / its ranks``,
which makes each of its steps read the same samples as one step of the strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from torch.utils.data import DataLoader, RandomSampler


class VerifyDataError(ValueError):
    """A data loader verify cannot give the reference with the strategy's global batch."""


def scaled_loader(loader: Any, scale: Fraction) -> Any:
    """``loader`` with its batch size multiplied by ``scale`` (a loader of any other kind is refused)."""
    if scale == 1:
        return loader
    if isinstance(loader, (list, tuple)):
        return type(loader)(scaled_loader(one, scale) for one in loader)
    if isinstance(loader, dict):
        return {key: scaled_loader(one, scale) for key, one in loader.items()}
    if not isinstance(loader, DataLoader) or loader.batch_size is None:
        raise VerifyDataError(
            f"verify needs DataLoaders with a batch_size to give the reference the strategy's global batch; got"
            f" {type(loader).__name__}{' with a custom batch_sampler' if isinstance(loader, DataLoader) else ''}."
            " Return a DataLoader(dataset, batch_size=...) from the *_dataloader hooks."
        )
    batch = loader.batch_size * scale
    if batch.denominator != 1:
        raise VerifyDataError(
            f"The global batch of {loader.batch_size} × {scale.numerator} samples per step cannot be split over the"
            f" reference's {scale.denominator} ranks. Choose a batch size or an --against with a number of ranks"
            " that divides it."
        )
    return DataLoader(
        loader.dataset,
        batch_size=int(batch),
        shuffle=isinstance(loader.sampler, RandomSampler),
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
    )


def scale_dataloader_hooks(owner: Any, scale: Fraction) -> None:
    """Make ``owner``'s (a LightningModule's or LightningDataModule's) ``train_dataloader`` and ``val_dataloader``
    return loaders scaled by ``scale``: an instance attribute wraps each method, so Lightning's calls reach it."""
    for hook in ("train_dataloader", "val_dataloader"):
        method = getattr(owner, hook, None)
        if callable(method):
            setattr(owner, hook, _scaled(method, scale))


def _scaled(method: Callable[[], Any], scale: Fraction) -> Callable[[], Any]:
    def hook() -> Any:
        return scaled_loader(method(), scale)

    return hook
