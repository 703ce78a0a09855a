"""The ``lightning-dist`` console script: a LightningCLI with the lightning_dist strategies registered, plus tools.

    lightning-dist fit --config configs/fsdp2.yaml
    lightning-dist validate --config configs/fsdp2.yaml --ckpt_path path/to/checkpoint
    lightning-dist <tool> ...        (the tools in lightning_dist.commands: see ``lightning-dist --help``)

Because the package is imported first, ``trainer.strategy: fsdp2`` (a registered name) works in the YAML as well as
``class_path: lightning_dist.FSDP2Strategy``. Like ``python -m``, the current directory is importable, so
``model.class_path`` can name a module of the project you run it from.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from typing_extensions import override

import lightning_dist  # noqa: F401  (registers the strategy names)
from lightning_dist.commands import TOOLS, fail, run_tool
from lightning_dist.plugins.precision import unsupported_precision_message
from lightning_dist.strategies.base import MeshParallelStrategy
from lightning_dist.strategies.lifecycle.preflight import FOUND_BEFORE_LAUNCH
from lightning_dist.strategies.registry import unknown_strategy_message


class DistCLI(LightningCLI):
    """LightningCLI that checks the strategy name, and the Trainer's precision against a lightning_dist strategy,
    before building anything.

    An unknown strategy name gets the list of registered names (Lightning's message shows a few of its own). Lightning
    builds a Transformer Engine plugin (and fails asking to install transformer_engine) before a strategy
    sees the flag; here the user is told that the strategies do not support it at all.
    """

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = (config or {}).get("trainer") or {}
        precision, strategy = trainer.get("precision"), trainer.get("strategy")
        if isinstance(strategy, str) and strategy != "auto" and strategy not in StrategyRegistry:
            raise SystemExit(f"trainer.strategy: {unknown_strategy_message(strategy)}")
        if str(precision).startswith("transformer-engine") and _is_ours(strategy):
            raise SystemExit(f"trainer.precision: {unsupported_precision_message(precision)}")


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


def main(args: list[str] | None = None) -> None:
    """Run a tool (``lightning-dist <tool> ...``) or a LightningCLI subcommand (fit, validate, test, predict).

    A mistake the strategy's checks find before launch (a missing or damaged ``ckpt_path`` among them) ends the
    subcommand with its message (``lightning-dist fit: error: ...``) and exit status 2, without a traceback; what
    fails after launch keeps its traceback.
    """
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in TOOLS:
        run_tool(argv[0], argv[1:])
        return
    import_from_cwd()
    try:
        DistCLI(
            **CLI_CLASSES,
            args=args,  # None: LightningCLI reads sys.argv itself (passing both makes it warn)
            parser_kwargs={"epilog": "tools: " + ", ".join(f"{name} ({doc})" for name, (_, doc) in TOOLS.items())},
            save_config_kwargs={"overwrite": True},
        )
    except Exception as error:
        if not getattr(error, FOUND_BEFORE_LAUNCH, False):
            raise
        subcommand = next((a for a in argv if not a.startswith("-")), "")
        fail(subcommand, str(error))


if __name__ == "__main__":
    main()
