"""The strategy of verify's default reference: the user's module trained in one process.

It is Lightning's DDP on one rank without the ``DistributedDataParallel`` wrapper. What the reference needs of DDP
stays: a process group of one (``torch.distributed`` calls in the user's code work, and report rank 0 of 1), the
distributed sampler Lightning puts into the loaders (it shuffles with the global seed, as under the strategy), and
``distributed_sampler_kwargs`` (``num_replicas=1``). The wrapper goes: on one rank there is nothing to reduce, and
it refuses modules that train correctly in one process (a parameter unused in a backward, as in manual optimization
with an optimizer per sub-network).
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_dist.parallel.runtime.random_state import rng_kept

#: Dotted path of :class:`OneProcessStrategy`, for a configuration's ``trainer.strategy.class_path``.
ONE_PROCESS_STRATEGY = f"{__name__}.OneProcessStrategy"


class OneProcessStrategy(DDPStrategy):
    """Lightning's DDP on one process, the module left unwrapped (see the module docstring)."""

    @override
    def setup_distributed(self) -> None:
        """DDP's, without its ``reset_seed()``: the random state goes on from where the user's code left it, as the
        strategies' does (rank 0's, which ran the same code)."""
        with rng_kept():
            super().setup_distributed()

    @override
    def configure_ddp(self) -> None:
        """Nothing to wrap: one rank has no gradients to reduce."""
