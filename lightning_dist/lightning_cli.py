"""The LightningCLI of ``lightning-dist fit`` (validate, test, predict) and of verify's runs: :class:`DistCLI`, which
checks the strategy name and the precision before building anything, builds the model on the meta device when the
strategy loads ``initial_weights``, and the arguments it is built with.

Importing the package registers the strategy names, so ``trainer.strategy: fsdp2`` (a registered name) works in the
YAML as well as ``class_path: lightning_dist.FSDP2Strategy``. The console entry is :mod:`lightning_dist.cli`.
"""

from __future__ import annotations

import importlib
import os
import sys
from contextlib import nullcontext
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

from lightning_dist.compat import lightning as lightning_compat
from lightning_dist.plugins.precision import unsupported_precision_message
from lightning_dist.strategies.base import MeshParallelStrategy
from lightning_dist.strategies.registry import unknown_strategy_message


class DistCLI(LightningCLI):
    """LightningCLI that checks the strategy name, and the Trainer's precision against a lightning_dist strategy,
    before building anything.

    An unknown strategy name gets the list of registered names (Lightning's message shows a few of its own). Lightning
    builds a Transformer Engine plugin (and fails asking to install transformer_engine) before a strategy
    sees the flag; here the user is told that the strategies do not support it at all.

    When the strategy's ``initial_weights`` is set, the model is built on the meta device (what
    ``trainer.init_module(empty_init=True)`` does in Python): the strategy materializes each rank's shards and loads
    their slices, so no rank holds the model whole. Lightning's own instantiator still builds it (the
    hyperparameters are saved as usual).
    """

    @override
    def _add_instantiators(self) -> None:
        super()._add_instantiators()
        self.parser.add_instantiator(
            _MetaDeviceModel(self, lightning_compat.ModelInstantiator(cli=self, key="model")),
            LightningModule,
            subclasses=True,
            prepend=True,
        )

    def builds_model_on_meta_device(self) -> bool:
        """Whether the strategy of the parsed config sets ``initial_weights``."""
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        strategy = ((config or {}).get("trainer") or {}).get("strategy")
        init_args = strategy.get("init_args") if hasattr(strategy, "get") else None
        return bool(init_args is not None and hasattr(init_args, "get") and init_args.get("initial_weights"))

    @override
    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Lightning's, but ``--print_config`` prints only a configuration whose strategy options the strategy
        accepts: the same refusal as ``fit``'s, first (jsonargparse prints without building the strategy)."""
        given = sys.argv[1:] if args is None else args
        if isinstance(given, list) and any(str(a).split("=")[0] == "--print_config" for a in given):
            config = parser.parse_args([a for a in given if str(a).split("=")[0] != "--print_config"])
            subcommand = config.get("subcommand")
            check_strategy_options(config.get(subcommand) if subcommand else config)
        super().parse_arguments(parser, args)

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = (config or {}).get("trainer") or {}
        precision, strategy = trainer.get("precision"), trainer.get("strategy")
        if isinstance(strategy, str) and strategy != "auto" and strategy not in StrategyRegistry:
            raise SystemExit(f"trainer.strategy: {unknown_strategy_message(strategy)}")
        if str(precision).startswith("transformer-engine") and _is_ours(strategy):
            raise SystemExit(f"trainer.precision: {unsupported_precision_message(precision)}")
        check_strategy_options(config)


def check_strategy_options(config: Any) -> None:
    """Build a lightning_dist strategy given as ``class_path``/``init_args`` in ``config`` (a subcommand's) once, to
    refuse its options with the strategy's own message on the first line (jsonargparse would bury it in a union
    error that dumps the whole namespace). A strategy whose options hold other classes is left to the CLI."""
    from jsonargparse import Namespace

    strategy = ((config or {}).get("trainer") or {}).get("strategy")
    class_path = strategy.get("class_path") if isinstance(strategy, Namespace) else None
    if not isinstance(class_path, str) or not class_path.startswith("lightning_dist"):
        return
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    init_args = strategy.get("init_args")
    options = init_args.as_dict() if isinstance(init_args, Namespace) else dict(init_args or {})
    if not isinstance(cls, type) or not issubclass(cls, MeshParallelStrategy):
        return
    if any(isinstance(value, dict) and "class_path" in value for value in options.values()):
        return
    try:
        cls(**options)
    except (ValueError, TypeError) as error:
        raise SystemExit(f"trainer.strategy: {error}") from None


class _MetaDeviceModel:
    """The model's instantiator: Lightning's, on the meta device when the strategy loads ``initial_weights``."""

    def __init__(self, cli: DistCLI, lightning_instantiator: Any) -> None:
        self.cli = cli
        self.lightning_instantiator = lightning_instantiator

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        context = torch.device("meta") if self.cli.builds_model_on_meta_device() else nullcontext()
        with context:
            return self.lightning_instantiator(
                class_type, *args, applied_instantiation_links=applied_instantiation_links, **kwargs
            )


def _is_ours(strategy: object) -> bool:
    """Whether a ``trainer.strategy`` config value (name, class path entry or instance) is a lightning_dist one."""
    if isinstance(strategy, str):
        return strategy in StrategyRegistry and issubclass(StrategyRegistry[strategy]["strategy"], MeshParallelStrategy)
    class_path = strategy.get("class_path", "") if hasattr(strategy, "get") else ""
    return str(class_path).startswith("lightning_dist") or isinstance(strategy, MeshParallelStrategy)


#: The LightningCLI arguments of ``lightning-dist fit`` (and of verify's runs): any module by class path, and any
#: datamodule, optional as in a plain LightningCLI: no ``datamodule_class``, which would make ``data:`` required, so a
#: YAML with only ``model:`` and ``trainer:`` trains from the module's own ``*_dataloader`` hooks.
CLI_CLASSES = {"model_class": LightningModule, "subclass_mode_model": True}


def import_from_cwd() -> None:
    """Like ``python -m``: the current directory is importable, so ``model.class_path`` may name a local module."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
