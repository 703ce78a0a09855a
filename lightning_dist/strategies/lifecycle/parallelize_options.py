"""How a strategy's options shape :func:`~lightning_dist.parallel.parallelize.parallelize` (a mixin of the base):
the FSDP-family options every strategy takes (``reshard_after_forward``, ``wrap_modules``/``wrap_regex``,
``activation_checkpointing``, ``accumulation_sync``, ``compile``; defined in the base's ``__init__``) turned into a
:class:`~lightning_dist.parallel.parallelize.ParallelizeConfig`, and the log lines of what it did."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch.nn import Module
from typing_extensions import override

from lightning_dist.parallel.describe import describe
from lightning_dist.parallel.fsdp import FSDPConfig
from lightning_dist.parallel.fsdp_options import resolve_reshard_after_forward
from lightning_dist.parallel.gradient_sync import AccumulationSync
from lightning_dist.parallel.module_selection import select_modules
from lightning_dist.parallel.parallelize import ParallelizeConfig, ParallelizeRecord

#: The shared options that change how a model is parallelized (recorded on a parallelized model, with the strategy's
#: own options, so that a second Trainer reuses it only with equal settings).
PARALLELIZE_OPTIONS = (
    "reshard_after_forward",
    "wrap_modules",
    "wrap_regex",
    "activation_checkpointing",
    "accumulation_sync",
    "float8",
    "float8_skip",
)

if TYPE_CHECKING:
    from lightning_dist.parallel.tensor_parallel import TensorParallelPlan
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object


class ParallelizeOptions(_Base):
    """The shared options as a parallelize config, the units they choose, and the log of what was applied."""

    def standard_parallelize_config(
        self, units: list[tuple[str, Module]], tp_plan: TensorParallelPlan | None = None, feeds_loss: bool = True
    ) -> ParallelizeConfig:
        """The :class:`~lightning_dist.parallel.parallelize.ParallelizeConfig` most strategies apply: ``units`` as
        the blocks, FSDP2 (HSDP with ``dp_replicate``) wherever the mesh has data-parallel ranks, this strategy's
        precision policies and its ``activation_checkpointing``, ``reshard_after_forward`` and ``compile``.

        ``feeds_loss=False`` for a pipeline stage before the last: its output goes to the next stage, which casts it
        to the compute dtype on arrival, so it is sent in that dtype (half the bytes and receive buffers of fp32 under
        ``bf16-mixed``, the same values) instead of the fp32 a loss gets."""
        dims = self.parallel_dims
        sharded = dims.fsdp > 1 or dims.dp_replicate > 1
        fsdp = FSDPConfig(
            reshard_after_forward=self.fsdp_reshard_after_forward(), mp_policy=self.precision_plugin.mp_policy
        )
        return ParallelizeConfig(
            units=units,
            tp_plan=tp_plan,
            activation_checkpointing=self.activation_checkpointing,
            keep_generation_cache=True,  # off in training steps only (StepProtocol.train_context)
            fsdp=fsdp if sharded else None,
            root_mp_policy=(self.precision_plugin.root_mp_policy if feeds_loss else self.precision_plugin.mp_policy)
            if sharded
            else None,
            compile=self.compile_options,
        )

    @property
    def compiles_quantization(self) -> bool:
        """Whether ZeRO++'s quantization kernels go through ``torch.compile``: on CUDA always (fewer kernel launches
        per collective), on the CPU with the ``compile`` option (1.65× faster kernels there, for a few seconds of
        compilation in every process)."""
        return self.root_device.type == "cuda" or self.compile_options is not None

    def fsdp_reshard_after_forward(self, default: bool = True) -> bool | int:
        """The ``reshard_after_forward`` FSDP2 applies: the option when given, else ``default`` (what the
        strategy's other options imply), except off under a pipeline (see :mod:`~lightning_dist.parallel.fsdp_options`)."""
        return resolve_reshard_after_forward(self.reshard_after_forward, self.parallel_dims, default)

    @property
    @override
    def accumulation_sync_mode(self) -> AccumulationSync:
        return self.accumulation_sync

    def shard_units(self, model: Module) -> list[tuple[str, Module]]:
        """The units of ``model`` the ``wrap_modules``/``wrap_regex`` options choose, else its repeated blocks
        (a ``ValueError`` naming the classes it holds when they choose nothing)."""
        return select_modules(model, self.wrap_modules, self.wrap_regex, what="shard")

    def log_layout(
        self,
        config: ParallelizeConfig,
        record: ParallelizeRecord,
        root: str,
        *,
        label: str | None = None,
        per_stage: bool = False,
        extras: Iterable[str] = (),
    ) -> None:
        """Log what :func:`~lightning_dist.parallel.parallelize.parallelize` did (see
        :func:`~lightning_dist.parallel.describe.describe`), and a deferred ``accumulation_sync``."""
        if self.accumulation_sync != "every":
            extras = [*extras, f"accumulation_sync={self.accumulation_sync!r}"]
        precision = str(self.precision_plugin.precision)
        lines = describe(
            config,
            record,
            self.parallel_dims,
            root=root,
            precision=precision,
            label=label,
            per_stage=per_stage,
            extras=extras,
        )
        for line in lines:
            self.log_decision(line)
