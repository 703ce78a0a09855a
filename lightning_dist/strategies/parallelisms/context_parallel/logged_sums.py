"""A sum logged over context-parallel ranks: each rank holds a shard of every sequence of its samples, so a value it
logs with ``reduce_fx="sum", sync_dist=True`` is summed over the data-parallel ranks and the ``cp`` ranks of each
sample. A per-token value (each rank counts its shard) then sums to one process's; a per-sample value (each rank
holds the same number) is counted ``cp`` times. Which one a value is cannot be told from it, so the first such call
of each name warns, with the remedy: sync it over the data-parallel ranks only."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_dist.strategies.lifecycle.logged_values import log_options, log_replaced, reduction


@contextmanager
def summed_logs_warned(module: nn.Module, cp: int, warned: set[str]) -> Iterator[None]:
    """Inside the block, ``module.log`` of a plain value with ``reduce_fx="sum"`` and ``sync_dist=True`` over the
    default group warns once per name (``warned`` holds the names already warned about)."""
    from torchmetrics import Metric

    log = module.log

    def checked(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        if name not in warned and not isinstance(value, Metric):
            options = log_options(name, value, args, kwargs)
            if options["sync_dist"] and options["sync_dist_group"] is None and reduction(options["reduce_fx"]) == "sum":
                warned.add(name)
                rank_zero_warn(summed_log_message(name, cp))
        return log(name, value, *args, **kwargs)

    with log_replaced(module, checked):
        yield


def summed_log_message(name: str, cp: int) -> str:
    return (
        f"context_parallel: self.log({name!r}, ..., reduce_fx='sum', sync_dist=True) sums over the {cp}"
        " context-parallel ranks of each sample as well as over the data-parallel ranks. A per-token value (each rank"
        " counts its own sequence shard) sums to one process's value; a per-sample value (a number of sequences, or"
        f" anything every context-parallel rank computes alike) is counted {cp} times. Log a per-sample value with"
        " sync_dist_group=getattr(self.trainer.strategy, 'data_parallel_group', None) (the ranks that hold different"
        " samples; ignored in one process), which sums it once per sample."
    )
