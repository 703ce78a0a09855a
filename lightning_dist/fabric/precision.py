"""The precision plugin of the Fabric strategies: Fabric's plugin interface over the Trainer strategies' dtype policy.

The policy (:class:`~lightning_dist.plugins.FSDP2Precision`, or ZeRO++'s) is the one object the Trainer strategy uses
to parallelize: FSDP2's mixed-precision policies, autocast where no FSDP2 unit casts, loss scaling for ``16-mixed``.
This plugin only speaks Fabric's calls to it (``optimizer_step(optimizer)``, ``backward(tensor, module)``,
``unscale_gradients``, ``convert_output``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.types import Optimizable
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dist.compat.lightning import convert_floating_point
from lightning_dist.plugins.precision import SUPPORTED_PRECISION, FSDP2Precision, unsupported_precision_message


class FabricMeshPrecision(Precision):
    """Fabric's precision calls answered by ``policy``, the dtype policy the strategy parallelizes with.

    Outputs of a ``bf16-true``/``16-true`` model are cast to the default dtype as Fabric's own ``HalfPrecision`` does
    (losses in fp32); ``64-true`` outputs stay fp64 (Fabric's ``DoublePrecision`` would cast them to fp32).
    """

    def __init__(self, policy: FSDP2Precision) -> None:
        self.policy = policy
        self.precision = policy.precision  # type: ignore[assignment]
        self._found_inf: bool | None = None  # 16-mixed: gradients unscaled (and checked) this step

    @override
    def convert_module(self, module: Module) -> Module:
        return self.policy.convert_module(module)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self.policy.tensor_init_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.policy.module_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.policy.forward_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return self.policy.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        if self.precision not in ("bf16-true", "16-true"):
            return data
        return apply_to_collection(data, Tensor, convert_floating_point, dst_type=torch.get_default_dtype())

    @override
    def pre_backward(self, tensor: Tensor, module: Module | None) -> Tensor:
        scaler = self.policy.scaler
        return scaler.scale(tensor) if scaler is not None else tensor

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        tensor.backward(*args, **kwargs)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        scaler = self.policy.scaler
        if scaler is not None and self._found_inf is None:
            self._found_inf = scaler.unscale_and_check(optimizer)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        scaler = self.policy.scaler
        if scaler is None:
            return optimizer.step(**kwargs)
        self.unscale_gradients(optimizer)  # type: ignore[arg-type]
        found_inf, self._found_inf = bool(self._found_inf), None
        output = None if found_inf else optimizer.step(**kwargs)  # the same decision on every rank
        scaler.update(found_inf)
        return output

    @override
    def main_params(self, optimizer: Optimizer) -> Any:
        return self.policy.main_params(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.policy.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.policy.load_state_dict(state_dict)

    @override
    def teardown(self) -> None:
        self.policy.teardown()


def precision_flag(plugin: Precision) -> str:
    """The precision flag of a plugin Fabric built from ``Fabric(precision=...)`` (or a policy the user passed),
    refusing plugins the strategies have no policy for."""
    from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    flag = str(getattr(plugin, "precision", ""))
    generic = type(plugin) in (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
    if (generic or isinstance(plugin, FSDP2Precision)) and flag in SUPPORTED_PRECISION:
        return flag
    if generic or flag.startswith("transformer-engine"):
        raise ValueError(unsupported_precision_message(flag))
    raise ValueError(
        f"The precision plugin {type(plugin).__name__} (precision={flag or '?'!r}) cannot be used with the"
        f" lightning_dist Fabric strategies. Pass Fabric(precision=...) with one of: {', '.join(SUPPORTED_PRECISION)}."
    )


def engine_precision_plugin(flag: str, given: Precision) -> Any:
    """The plugin the engine converts into its dtype policy: the user's policy object itself, or Lightning's generic
    plugin for the flag (the Trainer's route, so ZeRO++ makes its own policy of it)."""
    from lightning.pytorch.plugins.precision import Precision as TrainerPrecision

    if isinstance(given, FSDP2Precision):
        return given
    generic = TrainerPrecision()
    generic.precision = flag  # type: ignore[assignment]
    return generic
