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

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

import lightning_dist  # noqa: F401  (registers the strategy names)
from lightning_dist.commands import TOOLS, run_tool


def main(args: list[str] | None = None) -> None:
    """Run a tool (``lightning-dist <tool> ...``) or a LightningCLI subcommand (fit, validate, test, predict)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] in TOOLS:
        run_tool(argv[0], argv[1:])
        return
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=argv,
        parser_kwargs={"epilog": "tools: " + ", ".join(f"{name} ({doc})" for name, (_, doc) in TOOLS.items())},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
