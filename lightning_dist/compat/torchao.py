"""torchao, the optional library behind ``float8=...`` (``pip install 'lightning-dist[fp8]'``): every torchao name
lightning_dist uses, imported here only, with the version they were checked on.

torchao is imported lazily (when a strategy converts a model, never when lightning_dist is imported). On a machine
without CUDA its CUDA extension libraries fail to load with a warning per library, and its import logs torch's
deprecation of Enum pytree constants; both are dropped here (emulation does not use those libraries).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

#: The torchao versions the float8 code was tested with (pyproject's ``[fp8]`` extra pins the same range).
TESTED_TORCHAO = ">=0.18,<0.19"
INSTALL_LINE = "pip install 'lightning-dist[fp8]'  (or: pip install 'torchao>=0.18,<0.19')"

#: Names from torchao's prototype namespace (not covered by its compatibility promise): ``name -> (checked on, use)``.
PROTOTYPE_TORCHAO_NAMES: dict[str, tuple[str, str]] = {
    "MXFP8TrainingOpConfig": ("torchao 0.18.0", "float8='mxfp8': the MXFP8 training config of nn.Linear weights"),
    "MXFP8TrainingRecipe": ("torchao 0.18.0", "float8='mxfp8': the RCEIL recipe and its emulated variant"),
    "MXFP8TrainingWeightWrapperTensor": ("torchao 0.18.0", "float8='mxfp8': recognizing a converted weight"),
    "TrainingWeightWrapperBaseTensor": ("torchao 0.18.0", "float8='mxfp8': its ``_data`` unwrapped for checkpoints"),
}

#: torchao's weight wrappers (tensor subclasses holding the plain weight) and the attribute holding it, checked on
#: torchao 0.18.0: ``(module, class, attribute)``. A checkpoint must hold the plain tensor (see :func:`plain_state`).
_WEIGHT_WRAPPERS = (
    ("torchao.float8.fsdp_utils", "WeightWithDynamicFloat8CastTensor", "_tensor"),  # tensorwise FSDP2 all-gather
    ("torchao.prototype.moe_training.tensor", "TrainingWeightWrapperBaseTensor", "_data"),  # mxfp8
)


def torchao_version() -> str | None:
    """The installed torchao version, or ``None`` when torchao is not installed."""
    try:
        return version("torchao")
    except PackageNotFoundError:
        return None


def missing_torchao_message(what: str) -> str:
    return f"{what} needs torchao, which is not installed. Install it with: {INSTALL_LINE}"


#: Loggers that speak while torchao is imported: its own (a CUDA library that cannot load on a CPU build) and torch's
#: pytree registry (torchao 0.18 registers Enum classes as pytree constants, which torch 2.13 deprecates).
_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def _import(module: str) -> Any:
    """Import a torchao module without the warnings its import logs (see :data:`_IMPORT_LOGGERS`)."""
    loggers = [logging.getLogger(name) for name in _IMPORT_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def float8_linear_config(recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` (``"rowwise"``/``"tensorwise"``), emulated or not, with FSDP2's
    float8 all-gather (tensorwise only) and its precomputed scales."""
    float8 = _import("torchao.float8")
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def convert_linears_to_float8(model: nn.Module, config: Any, keep: Callable[[nn.Module, str], bool]) -> None:
    """Swap every ``nn.Linear`` of ``model`` that ``keep(module, name)`` accepts for a torchao ``Float8Linear``."""
    _import("torchao.float8").convert_to_float8_training(model, module_filter_fn=keep, config=config)


def mxfp8_config(*, emulate: bool) -> Any:
    """torchao's MXFP8 training config (RCEIL scales; the emulated variant on hardware without SM100 kernels),
    computing in the weights' own dtype."""
    config_module = _import("torchao.prototype.moe_training.config")
    recipe = config_module.MXFP8TrainingRecipe
    config = config_module.MXFP8TrainingOpConfig.from_recipe(
        recipe.MXFP8_EMULATED_RCEIL if emulate else recipe.MXFP8_RCEIL
    )
    return dataclasses.replace(config, out_dtype=None)


def convert_linears_to_mxfp8(model: nn.Module, config: Any, keep: Callable[[nn.Module, str], bool]) -> None:
    """Wrap the weight of every ``nn.Linear`` of ``model`` that ``keep(module, name)`` accepts in torchao's MXFP8
    training tensor (the module stays an ``nn.Linear``; its matmuls run in MXFP8)."""
    _import("torchao.quantization").quantize_(model, config, filter_fn=keep)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao FP8 linear: a ``Float8Linear``, or an ``nn.Linear`` whose weight is an MXFP8
    training tensor."""
    if torchao_version() is None:
        return False
    if isinstance(module, _import("torchao.float8.float8_linear").Float8Linear):
        return True
    # By name: importing torchao's prototype namespace only to ask would print its deprecation warnings.
    weight = getattr(module, "weight", None)
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return type(local).__name__ == "MXFP8TrainingWeightWrapperTensor"


def precompute_float8_scales(module: nn.Module) -> None:
    """One all-reduce computing the scales of every FSDP2-sharded float8 weight of ``module`` (after the optimizer
    step), so that the next forward's float8 all-gathers need no amax of their own."""
    _import("torchao.float8").precompute_float8_dynamic_scale_for_fsdp(module)


def float8_tensor_parallel_styles() -> tuple[type, type, type]:
    """torchao's ``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput``."""
    tp = _import("torchao.float8.float8_tensor_parallel")
    return tp.Float8ColwiseParallel, tp.Float8RowwiseParallel, tp.PrepareFloat8ModuleInput


def _unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor inside a torchao weight wrapper (the same storage), else ``tensor`` itself."""
    for module_name, class_name, attribute in _WEIGHT_WRAPPERS:
        module = sys.modules.get(module_name)  # not imported: no such tensor can exist
        if module is not None and isinstance(tensor, getattr(module, class_name)):
            return getattr(tensor, attribute)
    return tensor


def plain_tensor(tensor: Any) -> Any:
    """``tensor`` without torchao's weight wrapper: a wrapped tensor becomes the plain tensor it holds, a DTensor whose
    local tensor is wrapped becomes the same DTensor (mesh, placements, global shape) over the plain local tensor.
    Shares storage with the original, so loading into the result loads into the wrapped weight. Anything else is
    returned as is."""
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        inner = _unwrapped(local)
        if inner is local:
            return tensor
        return DTensor.from_local(
            inner, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
        )
    return _unwrapped(tensor) if isinstance(tensor, torch.Tensor) else tensor


def plain_state(state: Any) -> Any:
    """A (model or optimizer) state dict with every torchao weight wrapper removed (:func:`plain_tensor`), nested
    dicts and lists included: torchao's tensorwise FSDP2 weights (and mxfp8's) are tensor subclasses that
    ``torch.save`` would pickle by class name, so a checkpoint holding them could not be loaded with
    ``weights_only=True`` nor without torchao."""
    if isinstance(state, dict):
        return {key: plain_state(value) for key, value in state.items()}
    if isinstance(state, list):
        return [plain_state(value) for value in state]
    return plain_tensor(state)
