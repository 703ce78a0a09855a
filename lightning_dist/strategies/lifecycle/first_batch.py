"""The first batch an entry point will train (or evaluate) on, read in the launching process before launch.

A check of the data (context parallelism: does the batch hold token sequences?) costs nothing before the ranks exist
and a launch after. What ``fit``/``validate``/``test``/``predict`` were given is read: dataloaders, or a datamodule
(its ``setup`` runs here first). The batch is collated from the first samples of a map-style dataset, without
worker processes or the sampler; the random number generators are left as they were, so the training that follows
draws exactly what it would have drawn. Whatever cannot be read this way (an iterable dataset, a datamodule that
needs ``prepare_data`` or its Trainer, dataloaders the LightningModule builds) gives ``None``: the same check then
runs on the first batch after launch.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightning_dist.parallel.runtime.random_state import rng_kept

_READ = "_lightning_dist_first_batches"  # where ``arguments`` keeps what was read, per stage


def first_batch(arguments: dict[str, Any], stage: str) -> Any | None:
    """The first batch of the dataloader that ``stage`` (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``) will
    use, from the entry point's ``arguments``; ``None`` when it cannot be read without launching.

    The batch is read once per ``arguments`` and stage (kept in ``arguments``), so a datamodule's ``setup`` runs once
    for all the checks that ask (context parallelism and pipeline under hybrid3d)."""
    read = arguments.setdefault(_READ, {})
    if stage not in read:
        read[stage] = _read_first_batch(arguments, stage)
    return read[stage]


def _read_first_batch(arguments: dict[str, Any], stage: str) -> Any | None:
    try:
        with rng_kept():
            loader = _loader(arguments, stage)
            return _collate_first(loader) if isinstance(loader, DataLoader) else None
    except Exception:  # noqa: BLE001 (best effort: the check runs again on the first batch after launch)
        return None


def _loader(arguments: dict[str, Any], stage: str) -> Any:
    given = arguments.get("train_dataloaders" if stage == "fit" else "dataloaders")
    if given is None and arguments.get("datamodule") is not None:
        datamodule = arguments["datamodule"]
        datamodule.setup(stage)
        method = {"fit": "train_dataloader", "validate": "val_dataloader"}.get(stage, f"{stage}_dataloader")
        given = getattr(datamodule, method)()
    return _first_loader(given)


def _first_loader(given: Any) -> Any:
    if isinstance(given, DataLoader) or given is None:
        return given
    if isinstance(given, dict):
        return _first_loader(next(iter(given.values()), None))
    if isinstance(given, (list, tuple)):
        return _first_loader(given[0] if given else None)
    return None


def _collate_first(loader: DataLoader) -> Any | None:
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return None
    if loader.batch_size is None:  # the dataset yields whole batches
        return loader.collate_fn(dataset[0]) if loader.batch_sampler is None else None
    indices = range(min(loader.batch_size, len(dataset)))
    return loader.collate_fn([dataset[i] for i in indices])
