"""What ``planning/`` reads of a LightningModule, without importing Lightning (checked on Lightning 2.6.6).

The planner is pure PyTorch, yet it is handed LightningModules (``mesh: auto``, ``lightning-dist plan``). A model is a
LightningModule only once Lightning has been imported, so its class is looked up in ``sys.modules``, as
:mod:`.peft` does for PEFT's layers. The private attribute read here is listed in
:data:`~lightning_dist.compat.lightning.PRIVATE_LIGHTNING_NAMES`.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn


def attached_trainer(model: Any) -> Any:
    """The Trainer a LightningModule is attached to, without the property's error (``None`` when none or when
    ``model`` is a plain module)."""
    return getattr(model, "_trainer", None)


def is_lightning_default_forward(model: nn.Module) -> bool:
    """Whether ``model`` is a LightningModule without a ``forward`` of its own (LightningModule's)."""
    lightning = sys.modules.get("lightning.pytorch")
    if lightning is None:  # Lightning was never imported: no model is a LightningModule
        return False
    module_class = lightning.LightningModule
    return isinstance(model, module_class) and type(model).forward is module_class.forward
