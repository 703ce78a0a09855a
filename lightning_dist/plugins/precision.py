"""The precision plugin of lightning_dist strategies: dtype policy for FSDP2/DTensor models."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dist.compat.lightning import DefaultDtype, convert_floating_point
from lightning_dist.parallel.dtensor_values import FullTensorValues
from lightning_dist.parallel.grad_clip import clip_grad_norm_, clip_grad_value_

PrecisionFlag = Literal["32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = get_args(PrecisionFlag)

_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}


class FSDP2Precision(Precision):
    """Precision for FSDP2/DTensor models.

    ``*-mixed`` keeps sharded parameters in fp32 at rest and lets FSDP2 gather them in the low-precision dtype for
    compute (``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)``): gradients are reduced in fp32.
    ``16-mixed`` adds dynamic loss scaling; a non-finite gradient on any rank skips the step on every rank.
    ``*-true`` converts the whole model to that dtype.

    Args:
        precision: One of ``"32-true"``, ``"64-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
            ``"16-true"``.
        init_scale: Initial loss scale for ``"16-mixed"``.
        growth_interval: Steps without overflow after which the ``"16-mixed"`` loss scale doubles.
    """

    def __init__(self, precision: PrecisionFlag = "32-true", init_scale: float = 2.0**16, growth_interval: int = 2000):
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(unsupported_precision_message(precision))
        self.precision = precision  # type: ignore[assignment]
        kind, _, mode = precision.partition("-")
        self._dtype = _DTYPES[kind]
        self._mixed = mode == "mixed"
        self.scaler = _LossScaler(init_scale, growth_interval) if precision == "16-mixed" else None
        self._autocast_device: str | None = None
        #: Set by the strategy when pipeline stages hold different parameters (gradient norms sum over them).
        self.stage_group: dist.ProcessGroup | None = None

    def use_autocast(self, device_type: str) -> None:
        """Compute in the low-precision dtype through ``torch.autocast`` instead of FSDP2's parameter casting.

        For models with no FSDP2 module (pure tensor parallelism) ``mp_policy`` has nothing to act on. Under autocast
        parameters and gradients stay fp32 as with FSDP2 mixed precision, matmuls run in bf16/fp16, and autocast
        keeps norms, softmax and losses in fp32 (FSDP2 runs whole blocks in the low-precision dtype). No effect for
        ``*-true`` precisions.
        """
        if self._mixed:
            self._autocast_device = device_type

    @property
    def mp_policy(self) -> MixedPrecisionPolicy:
        """The FSDP2 policy for the sharded blocks."""
        if self._mixed:
            return MixedPrecisionPolicy(param_dtype=self._dtype, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    @property
    def root_mp_policy(self) -> MixedPrecisionPolicy:
        """The policy for the root module: mixed precision hands fp32 outputs (logits) to the loss."""
        if self._mixed:
            return MixedPrecisionPolicy(param_dtype=self._dtype, reduce_dtype=torch.float32, output_dtype=torch.float32)
        return MixedPrecisionPolicy()

    @override
    def convert_module(self, module: Module) -> Module:
        return module if self._mixed or self._dtype == torch.float32 else module.to(dtype=self._dtype)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        if self._mixed or self._dtype == torch.float32:
            return nullcontext()
        return DefaultDtype(self._dtype)

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        if self._autocast_device is not None:
            return torch.autocast(self._autocast_device, dtype=self._dtype)
        return self.tensor_init_context()

    @override
    def convert_input(self, data: Any) -> Any:
        if self._mixed or self._dtype == torch.float32:
            return data
        return apply_to_collection(data, function=convert_floating_point, dtype=Tensor, dst_type=self._dtype)

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            return None  # backward was skipped by the user
        found_inf = self.scaler.unscale_and_check(optimizer)
        self._after_closure(model, optimizer)
        step_output = None if found_inf else optimizer.step(**kwargs)
        self.scaler.update(found_inf)
        return step_output

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Optimizable) -> None:
        # The user's on_before_optimizer_step hooks run here: Lightning's grad_norm() helper builds a tensor of
        # per-parameter norms, which are DTensors under sharding (see parallel/dtensor_values.py).
        with FullTensorValues():
            super()._after_closure(model, optimizer)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val, stage_group=self.stage_group)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: float) -> None:
        clip_grad_value_(self.main_params(optimizer), clip_val)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def unsupported_precision_message(precision: object) -> str:
    message = (
        f"precision={precision!r} is not supported by lightning_dist strategies. Supported:"
        f" {', '.join(SUPPORTED_PRECISION)}."
    )
    if str(precision).startswith("transformer-engine"):
        message += (
            " FP8 training through Transformer Engine is not implemented by lightning_dist: installing"
            " transformer_engine does not change this. Use precision='bf16-mixed' (or '32-true') with the strategy"
            " option float8='rowwise' or 'tensorwise' for FP8 matmuls through torchao (docs/float8.md)."
        )
    return message


def to_fsdp2_precision(plugin: Precision | None) -> FSDP2Precision | None:
    """Convert the generic plugin the Trainer builds for an unknown strategy into an :class:`FSDP2Precision`.

    Raises ``ValueError`` for plugins that have no FSDP2 equivalent, listing the supported flags.
    """
    from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision

    if plugin is None or isinstance(plugin, FSDP2Precision):
        return plugin
    if type(plugin) in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
        flag = "64-true" if isinstance(plugin, DoublePrecision) else str(plugin.precision)
        if flag in SUPPORTED_PRECISION:
            return FSDP2Precision(flag)  # type: ignore[arg-type]
        raise ValueError(unsupported_precision_message(flag))
    if str(getattr(plugin, "precision", "")).startswith("transformer-engine"):
        raise ValueError(unsupported_precision_message(plugin.precision))
    raise ValueError(
        f"The precision plugin {type(plugin).__name__} (precision={getattr(plugin, 'precision', '?')!r}) cannot be"
        f" used with lightning_dist strategies. Pass `precision=` with one of: {', '.join(SUPPORTED_PRECISION)},"
        " or an FSDP2Precision instance."
    )


class _LossScaler:
    """Dynamic loss scaling whose skip decision is the same on every rank."""

    def __init__(self, init_scale: float, growth_interval: int, growth_factor: float = 2.0, backoff: float = 0.5):
        self.scale_value = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_factor = growth_factor
        self.backoff = backoff
        self._good_steps = 0
        self.skipped_steps = 0

    def scale(self, loss: Tensor) -> Tensor:
        return loss * self.scale_value

    def unscale_and_check(self, optimizer: Optimizable) -> bool:
        """Divide gradients by the scale in place; return whether any rank saw a non-finite gradient."""
        inv_scale = 1.0 / self.scale_value
        found = torch.zeros(())
        for group in optimizer.param_groups:  # type: ignore[union-attr]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                grad.mul_(inv_scale)
                if not torch.isfinite(grad).all():
                    found.fill_(1.0)
        if dist.is_available() and dist.is_initialized():
            found = found.to(_collective_device())
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale_value *= self.backoff
            self._good_steps = 0
            self.skipped_steps += 1
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self.scale_value *= self.growth_factor
            self._good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
