"""Every private Lightning, lightning_utilities and torchmetrics API lightning_dist relies on, in one place, with the
versions it was checked on.

Public Lightning APIs are used directly everywhere else (``tests/test_compat.py`` reads the package's syntax tree to
keep it so). When a Lightning release moves one of these names, this file is where it gets fixed.

Lightning is imported where a name is used, not when this module is imported. What ``planning/`` reads of a
LightningModule is in :mod:`.lightning_module`, which never imports Lightning (``attached_trainer`` is imported here
too, for the strategies).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch

from lightning_dist.compat.lightning_module import attached_trainer  # noqa: F401  (for the strategies)

#: Every private name used below: ``name -> (checked on, used for)``. tests/test_compat.py checks the list is complete.
PRIVATE_LIGHTNING_NAMES: dict[str, tuple[str, str]] = {
    "_convert_fp_tensor": ("Lightning 2.6.6", "plugins/precision.py: cast floating-point inputs to the precision"),
    "_DtypeContextManager": ("Lightning 2.6.6", "plugins/precision.py: default dtype while the module is created"),
    "_set_sampler_epoch": ("Lightning 2.6.6", "strategies/lifecycle/data_position.py: the epoch of a resumed sampler"),
    "_get_default_process_group_backend_for_device": (
        "Lightning 2.6.6",
        "strategies/lifecycle/processes.py: nccl or gloo",
    ),
    "_init_dist_connection": ("Lightning 2.6.6", "strategies/lifecycle/processes.py: the default process group"),
    "_sync_ddp_if_available": ("Lightning 2.6.6", "strategies/lifecycle/collectives.py: reduce a tensor over a group"),
    "_optimizers_to_device": (
        "Lightning 2.6.6",
        "strategies/lifecycle/model_setup.py: optimizer state onto the device",
    ),
    "_PATH": ("Lightning 2.6.6", "plugins, strategies/lifecycle/checkpointing.py: CheckpointIO's path type"),
    "_Stateful": (
        "Lightning 2.6.6",
        "strategies/lifecycle/data_position.py: a dataloader with state_dict/load_state_dict",
    ),
    "_Launcher": (
        "Lightning 2.6.6",
        "strategies/lifecycle/preflight.py: base of the launcher that checks before launch",
    ),
    "_SubprocessScriptLauncher": ("Lightning 2.6.6", "strategies/lifecycle/preflight.py: the devices=N launcher"),
    "_BackwardSyncControl": ("Lightning 2.6.6", "fabric/no_sync.py: fabric.no_backward_sync over FSDP2 units"),
    "_lightning_module": (
        "Lightning 2.6.6",
        "fabric/strategy.py: the module a Trainer strategy used by a Fabric strategy finds submodules in",
    ),
    "_SIGNUM": ("Lightning 2.6.6", "strategies/lifecycle/preflight.py: the signal type of Launcher.kill"),
    "_skip_backward": (
        "Lightning 2.6.6",
        "strategies/parallelisms/pipeline/stages.py: the schedule runs backward, not the loop",
    ),
    "_reset_optimizers_and_schedulers": (
        "Lightning 2.6.6",
        "strategies/lifecycle/model_setup.py: fit then test on one Trainer",
    ),
    "_device_mesh": (
        "Lightning 2.6.6",
        "strategies/lifecycle/processes.py: LightningModule.device_mesh of the strategy's mesh",
    ),
    "_forward_redirection": (
        "Lightning 2.6.6",
        "strategies/lifecycle/step_protocol.py: steps run through the wrapped model",
    ),
    "_trainer": ("Lightning 2.6.6", "planning/recommend.py: a LightningModule's Trainer, left out of a model copy"),
    "_ModelCheckpoint__resolve_ckpt_dir": (
        "Lightning 2.6.6",
        "strategies/lifecycle/interrupted_saves.py: the folder a ModelCheckpoint without dirpath saves into",
    ),
    "_find_last_checkpoints": (
        "Lightning 2.6.6",
        "strategies/lifecycle/interrupted_saves.py: what ckpt_path='last' lists",
    ),
    "_average_model": (
        "Lightning 2.6.6",
        "strategies/lifecycle/weight_averaging.py: the averaged copy of WeightAveraging and StochasticWeightAveraging",
    ),
    "_device": (
        "Lightning 2.6.6",
        "strategies/lifecycle/weight_averaging.py: the device of WeightAveraging(device=...)",
    ),
    "_clear_schedulers": (
        "Lightning 2.6.6",
        "strategies/lifecycle/weight_averaging.py: StochasticWeightAveraging's scheduler hand-over on resume",
    ),
    "_add_instantiators": (
        "Lightning 2.6.6",
        "lightning_cli.py: where LightningCLI registers its model instantiator, wrapped for the meta device",
    ),
    "_InstantiatorFn": (
        "Lightning 2.6.6",
        "lightning_cli.py: LightningCLI's model instantiator (it saves the hyperparameters), run on the meta device",
    ),
    "_defaults": ("torchmetrics 1.9.0", "strategies/parallelisms/pipeline/logs.py: the names of a Metric's states"),
    "_update_count": ("torchmetrics 1.9.0", "strategies/parallelisms/pipeline/logs.py: how often a Metric was updated"),
    "_forward_cache": ("torchmetrics 1.9.0", "strategies/parallelisms/pipeline/logs.py: a Metric's step value"),
    "_computed": ("torchmetrics 1.9.0", "strategies/parallelisms/pipeline/logs.py: a Metric's cached compute() result"),
    "_reduce_states": (
        "torchmetrics 1.9.0",
        "strategies/parallelisms/pipeline/logs.py: merge micro-batch states of a Metric",
    ),
    "_layer_sync": (
        "Lightning 2.6.6",
        "strategies/lifecycle/layer_sync.py: the plugin Trainer(sync_batchnorm=True) gives a parallel strategy",
    ),
    "_load": (
        "Lightning 2.6.6",
        "plugins/folder_loading.py: the loader load_from_checkpoint and TorchCheckpointIO call (as pl_load)",
    ),
    "_to_sync": (
        "torchmetrics 1.9.0",
        "strategies/parallelisms/pipeline/logs.py: compute a Metric without a collective",
    ),
}

_LAZY_TYPES = {
    # name here: (module, Lightning's private name, what it is)
    "StrOrPath": ("lightning.fabric.utilities.types", "_PATH", "str | Path: the path type of CheckpointIO's methods"),
    "Stateful": ("lightning.fabric.utilities.types", "_Stateful", "objects with state_dict/load_state_dict"),
    "LauncherBase": ("lightning.pytorch.strategies.launchers.launcher", "_Launcher", "base class of launchers"),
    "SubprocessScriptLauncherBase": (
        "lightning.pytorch.strategies.launchers.subprocess_script",
        "_SubprocessScriptLauncher",
        "the launcher of devices=N (the script started again per rank)",
    ),
    "FabricSubprocessScriptLauncher": (
        "lightning.fabric.strategies.launchers.subprocess_script",
        "_SubprocessScriptLauncher",
        "Fabric's launcher of devices=N (the script started again per rank)",
    ),
    "BackwardSyncControl": (
        "lightning.fabric.strategies.strategy",
        "_BackwardSyncControl",
        "what a Fabric strategy's no_backward_sync answers with",
    ),
    "SignalNumber": ("lightning.pytorch.trainer.connectors.signal_connector", "_SIGNUM", "a launcher's kill signal"),
    "DefaultDtype": ("lightning.fabric.plugins.precision.utils", "_DtypeContextManager", "a default dtype within it"),
    "ModelInstantiator": ("lightning.pytorch.cli", "_InstantiatorFn", "LightningCLI's instantiator of model and data"),
}


def __getattr__(name: str) -> Any:
    """The Lightning types of :data:`_LAZY_TYPES`, imported on first use."""
    if name not in _LAZY_TYPES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, private, _ = _LAZY_TYPES[name]
    return getattr(importlib.import_module(module), private)


# ---------------------------------------------------------------------------------------------------- precision
def convert_floating_point(tensor: torch.Tensor, dst_type: str | torch.dtype) -> torch.Tensor:
    """``tensor`` cast to ``dst_type`` when it is a floating-point tensor, else unchanged."""
    from lightning.fabric.plugins.precision.utils import _convert_fp_tensor

    return _convert_fp_tensor(tensor, dst_type)


# ---------------------------------------------------------------------------------------------------- processes
def default_process_group_backend(device: torch.device) -> str:
    """The backend Lightning picks for ``device`` (``nccl`` for CUDA, ``gloo`` otherwise)."""
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return _get_default_process_group_backend_for_device(device)


def init_process_group(cluster_environment: Any, backend: str, **kwargs: Any) -> None:
    """Initialize the default process group from a Lightning ``ClusterEnvironment`` (``kwargs`` go to
    ``torch.distributed.init_process_group``)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    _init_dist_connection(cluster_environment, backend, **kwargs)


def all_reduce_if_distributed(tensor: torch.Tensor, group: Any = None, reduce_op: Any = None) -> torch.Tensor:
    """``tensor`` reduced over ``group`` when torch.distributed is initialized, else ``tensor`` (``reduce_op``:
    a ``ReduceOp`` or ``"mean"``/``"sum"``)."""
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available

    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


# ---------------------------------------------------------------------------------------------------- model and optimizers
def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move the state of every optimizer onto ``device``."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def reset_optimizers_and_schedulers(strategy: Any) -> None:
    """Drop a Lightning strategy's optimizers, schedulers and their precision wrappers."""
    strategy._reset_optimizers_and_schedulers()


def forward_redirection(strategy: Any) -> Any:
    """A Lightning strategy's ``_ForwardRedirection``: ``redirection(wrapper, module, method, *args)`` runs
    ``module.method`` through ``wrapper``'s forward (its hooks)."""
    return strategy._forward_redirection


def set_strategy_module(strategy: Any, module: Any) -> None:
    """Make ``module`` (a plain ``nn.Module`` in a Fabric loop) what a Trainer strategy's ``lightning_module`` returns,
    without a Trainer connecting it."""
    strategy._lightning_module = module


def set_device_mesh(lightning_module: Any, mesh: Any) -> None:
    """What ``LightningModule.device_mesh`` returns (the property has no setter)."""
    lightning_module._device_mesh = mesh


# ---------------------------------------------------------------------------------------------------- checkpoints
def model_checkpoint_dir(callback: Any, trainer: Any) -> str:
    """The folder a ``ModelCheckpoint`` saves into: its ``dirpath``, or the one it derives from the logger or the
    Trainer's ``default_root_dir`` (what ``ckpt_path="last"`` lists)."""
    return callback._ModelCheckpoint__resolve_ckpt_dir(trainer)


def last_checkpoints(callback: Any, trainer: Any) -> set[str]:
    """The ``last*.ckpt`` paths in a ``ModelCheckpoint``'s folder, which ``ckpt_path="last"`` chooses from."""
    return set(callback._find_last_checkpoints(trainer))


def restores_a_checkpoint(trainer: Any, ckpt_path: Any) -> bool:
    """Whether the Trainer entry point called with ``ckpt_path`` will restore a checkpoint, by the rules of
    Lightning's ``_CheckpointConnector._parse_ckpt_path``: ``None`` restores nothing (unless, when fitting, an
    ``OnExceptionCheckpoint`` makes it ``"last"``), ``"last"`` only when one of the paths it chooses from exists (a
    first run of a restartable job has none), any other value always (Lightning raises where it finds nothing)."""
    from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
    from lightning.pytorch.trainer.states import TrainerFn

    if trainer is None:  # a Fabric loop: it restores what it loads itself
        return False
    on_exception = [cb for cb in trainer.callbacks if isinstance(cb, OnExceptionCheckpoint)]
    if ckpt_path is None and on_exception and trainer.state.fn == TrainerFn.FITTING:
        ckpt_path = "last"
    if ckpt_path is None:
        return False
    if str(ckpt_path) != "last":
        return True
    candidates = {getattr(cb, "ckpt_path", None) for cb in on_exception}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= last_checkpoints(callback, trainer)
    return any(get_filesystem(path).exists(path) for path in candidates if path)


def get_filesystem(path: Any) -> Any:
    """The fsspec file system of ``path`` (local or a URL), as Lightning resolves checkpoint paths."""
    from lightning.fabric.utilities.cloud_io import get_filesystem as lightning_filesystem

    return lightning_filesystem(path)


def layer_sync(strategy: Any) -> Any:
    """The layer-sync plugin Lightning gave ``strategy`` (``Trainer(sync_batchnorm=True)``), or ``None``."""
    return getattr(strategy, "_layer_sync", None)


#: The modules whose ``pl_load`` (Lightning's ``cloud_io._load``) reads a checkpoint path: ``LightningModule``'s and
#: ``LightningDataModule``'s ``load_from_checkpoint``, and ``TorchCheckpointIO`` (Lightning's own strategies' resume).
CHECKPOINT_LOADER_MODULES = ("lightning.pytorch.core.saving", "lightning.fabric.plugins.io.torch_io")


def route_checkpoint_loading(wrap: Any) -> None:
    """Replace ``pl_load`` in :data:`CHECKPOINT_LOADER_MODULES` with ``wrap(Lightning's loader)`` (once)."""
    for name in CHECKPOINT_LOADER_MODULES:
        module = importlib.import_module(name)
        if not getattr(module.pl_load, "lightning_dist_routed", False):
            module.pl_load = wrap(module.pl_load)
            module.pl_load.lightning_dist_routed = True


# ---------------------------------------------------------------------------------------------------- loops and data
def skip_lightning_backward(automatic_optimization: Any, value: bool) -> None:
    """Whether Lightning's automatic-optimization closure skips ``zero_grad`` and ``backward`` (the pipeline
    schedule runs them)."""
    automatic_optimization._skip_backward = value


def set_sampler_epoch(dataloader: object, epoch: int) -> None:
    """``set_epoch(epoch)`` on the dataloader's sampler and batch sampler, where they have it."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(dataloader, epoch)


# ---------------------------------------------------------------------------------------------------- callbacks
def averaged_copy(callback: Any) -> Any:
    """The averaged copy a ``WeightAveraging`` (an ``AveragedModel``) or ``StochasticWeightAveraging`` (a copy of
    the LightningModule) callback keeps; ``None`` before its ``setup``."""
    return callback._average_model


def set_averaged_copy(callback: Any, copy: Any) -> None:
    """Replace the averaged copy of a ``WeightAveraging`` or ``StochasticWeightAveraging`` callback."""
    callback._average_model = copy


def clear_schedulers_for_swa(trainer: Any) -> None:
    """What ``StochasticWeightAveraging`` does in ``on_fit_start`` when it restored a scheduler state: drop the
    Trainer's schedulers, so that the checkpoint's ``SWALR`` state is not loaded into the module's own scheduler
    (the callback builds its ``SWALR`` again when its first epoch starts and loads that state into it)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    StochasticWeightAveraging._clear_schedulers(trainer)


def averaging_device(callback: Any) -> Any:
    """The ``device`` a ``WeightAveraging`` callback was given for its averaged copy (``None``: the model's)."""
    return callback._device


def set_averaging_device(callback: Any, device: Any) -> None:
    """Where a ``WeightAveraging`` callback's ``setup`` puts the averaged copy it makes."""
    callback._device = device


# ---------------------------------------------------------------------------------------------------- torchmetrics
def metric_state_names(metric: Any) -> list[str]:
    """The names of the states a torchmetrics ``Metric`` registered with ``add_state``."""
    return list(metric._defaults)


def metric_update_count(metric: Any) -> int:
    """How often ``update`` ran on the metric since its last reset."""
    return metric._update_count


def metric_step_value(metric: Any) -> Any:
    """The value of the metric's last ``forward`` call (what ``self.log(name, metric)`` logs per step)."""
    return metric._forward_cache


def metric_cached_compute(metric: Any) -> Any:
    """The cached result of the metric's ``compute`` (``None`` when it will compute again)."""
    return metric._computed


def set_metric_update_count(metric: Any, update_count: int) -> None:
    """Set how often ``update`` ran on the metric (what its state merge weights by)."""
    metric._update_count = update_count


def set_metric_step_value(metric: Any, step_value: Any, cached_compute: Any = None) -> None:
    """Set the metric's step value and its cached ``compute`` result (``None``: compute again)."""
    metric._forward_cache = step_value
    metric._computed = cached_compute


def merge_metric_states(metric: Any, states: dict[str, Any]) -> None:
    """Merge ``states`` (another copy's states) into the metric's own, with each state's reduction."""
    metric._reduce_states(states)


def compute_metric_locally(metric: Any) -> Any:
    """The metric's ``compute()`` on this process's states alone (no collective), not cached."""
    to_sync, metric._to_sync = metric._to_sync, False
    metric._computed = None
    try:
        return metric.compute()
    finally:
        metric._to_sync = to_sync
