"""FP8 training in a lightning_dist strategy (a mixin of the shared base): the ``float8`` and ``float8_skip``
options (or a :class:`~lightning_dist.plugins.Float8Precision` plugin) checked before launch, the model's
``nn.Linear`` layers converted before any parallelism (:mod:`lightning_dist.parallel.float8`), and, for tensorwise
under FSDP2, the FP8 all-gather's scales precomputed after every optimizer step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module

from lightning_dist.compat.torchao import missing_torchao_message, torchao_version
from lightning_dist.parallel.float8 import (
    Float8Recipe,
    Float8Settings,
    convert_to_float8,
    float8_emulation,
    precompute_float8_scales,
    uses_float8_all_gather,
)
from lightning_dist.parallel.model_structure import recognize

if TYPE_CHECKING:
    from lightning_dist.strategies.base import MeshParallelStrategy

    _Base = MeshParallelStrategy
else:
    _Base = object


class Float8Setup(_Base):
    """The ``float8`` option of :class:`~lightning_dist.strategies.base.MeshParallelStrategy`."""

    _float8_all_gather = False

    @property
    def float8_recipe(self) -> Float8Recipe | None:
        """The recipe in use: the ``float8`` option, else a :class:`~lightning_dist.plugins.Float8Precision`'s."""
        plugin = getattr(self.precision_plugin, "float8", None)
        if self.float8 is not None and plugin is not None and plugin != self.float8:
            raise ValueError(
                f"The strategy says float8={self.float8!r} and the precision plugin Float8Precision says"
                f" recipe={plugin!r}: give the recipe once (either one)."
            )
        return self.float8 or plugin

    @property
    def float8_skip_patterns(self) -> tuple[str, ...]:
        return self.float8_skip or getattr(self.precision_plugin, "float8_skip", ())

    def _float8_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        return devices[0]

    def _has_custom_all_gather(self) -> bool:
        """ZeRO++ (the zeropp strategy, hybrid3d's ``zeropp``) all-gathers weights its own way."""
        return type(self).__name__ == "ZeroPPStrategy" or bool(getattr(self, "zeropp", False))

    def check_float8(self, trainer: pl.Trainer | None = None) -> None:
        """Before launch: torchao installed, FP8 kernels on this GPU (emulation on the CPU), no setting that cannot
        carry FSDP2's float8 all-gather, and no checkpoint callback for mxfp8 (``trainer``'s callbacks)."""
        recipe = self.float8_recipe
        if recipe is None:
            return
        if torchao_version() is None:
            raise ModuleNotFoundError(missing_torchao_message(f"float8={recipe!r}"))
        device = self._float8_device()
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        float8_emulation(recipe, device.type, capability)
        raf = self.reshard_after_forward
        if recipe == "tensorwise" and isinstance(raf, int) and not isinstance(raf, bool):
            raise ValueError(
                f"float8='tensorwise' all-gathers FP8 weights through FSDP2's tensor-subclass hooks, which torch does"
                f" not support with an int reshard_after_forward={raf} (a partial reshard, as ZeRO++'s hpZ). Use"
                " reshard_after_forward=True or False, or float8='rowwise' (weights all-gathered in the base"
                " precision)."
            )
        if recipe == "mxfp8" and trainer is not None and trainer.checkpoint_callbacks:
            raise ValueError(
                "float8='mxfp8' runs cannot be checkpointed yet: torchao 0.18 keeps MXFP8 weights, and the optimizer"
                " state made from them, as its own tensor subclass, which a checkpoint would pickle as such (it could"
                " not be loaded with weights_only=True, nor without torchao). Pass Trainer(enable_checkpointing=False)"
                " and no ModelCheckpoint, or use float8='rowwise' or 'tensorwise', whose checkpoints hold plain tensors."
            )

    def convert_float8(self, model: Module) -> None:
        """At setup, before parallelizing: convert ``model``'s linears (log line: converted, skipped and why); on
        CUDA turn ``compile`` on unless the user set it (FP8 is only fast compiled)."""
        recipe = self.float8_recipe
        if recipe is None:
            return
        device = self.root_device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        emulate = float8_emulation(recipe, device.type, capability)
        dims = self.parallel_dims
        sharded = dims.fsdp > 1 or dims.dp_replicate > 1
        self._float8_all_gather = uses_float8_all_gather(recipe, sharded, self._has_custom_all_gather())
        settings = Float8Settings(
            recipe=recipe,
            skip=self.float8_skip_patterns,
            emulate=emulate,
            fsdp_float8_all_gather=self._float8_all_gather,
            head=recognize(model).output_head,
        )
        record = convert_to_float8(model, settings)
        self.log_decision(record.describe())
        if emulate:
            rank_zero_warn(
                f"float8={recipe!r} runs emulated on the CPU (FP8 rounding, matmuls in the base precision): it checks"
                " numerics only and is slower than training without float8.",
                category=UserWarning,
            )
        if device.type == "cuda" and self.compile_options is None and not self.compile_set:
            self.compile_options = {}
            self.log_decision("compile turned on: FP8 is only fast compiled (set compile=False to keep it off)")

    def float8_after_optimizer_step(self) -> None:
        """Tensorwise under FSDP2: every float8 weight's scale for the next forward, in one all-reduce."""
        if self._float8_all_gather:
            precompute_float8_scales(self.model_parts)
