"""A plain LightningCLI that never imports lightning_dist itself: `class_path` in the YAML must be enough."""

import sys

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

if __name__ == "__main__":
    assert "lightning_dist" not in sys.modules
    LightningCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True)
