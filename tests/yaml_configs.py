"""Building the Trainer, model and data of a YAML config the way `lightning-dist fit --config` does, without running."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI

REPO_ROOT = Path(__file__).resolve().parents[1]


def cli_from_config(config: str | Path, *args: str) -> LightningCLI:
    """LightningCLI for ``config`` (a path relative to the repository root, or absolute) plus command-line ``args``."""
    return LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", str(REPO_ROOT / config), "--trainer.logger=false", *args],
        save_config_callback=None,
    )
