"""What a verify run is asked to do, and the Trainer settings both of its runs get from it.

Both runs train the user's configuration with a few settings replaced: ``max_steps`` (and no other stopping rule),
validation once at the end on two batches when the configuration validates, no checkpoint or early-stopping
callbacks and a logger inside verify's own folder (so nothing of the user's is written or overwritten), and for
``--dtype float64`` the ``64-true`` precision. The user's data settings (``use_distributed_sampler``, their own
samplers) are kept. The reference also gets its strategy and its number of processes.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Checkpoint, EarlyStopping

from lightning_dist.verification.one_process import ONE_PROCESS_STRATEGY

#: ``--against`` value of the default reference: the same module trained in one process.
ONE_PROCESS = "one_process"
#: Validation batches each run validates on (when the configuration validates at all).
VALIDATION_BATCHES = 2
#: Default tolerance per precision (relative; see :mod:`lightning_dist.verification.compare`).
DEFAULT_TOLERANCES = {"64-true": 1e-10, "32-true": 1e-4, "32": 1e-4}
#: Default tolerance of a mixed or half precision: the strategy and one process round differently.
LOW_PRECISION_TOLERANCE = 2e-2


@dataclasses.dataclass
class VerifySettings:
    """The options of ``lightning-dist verify`` (and of :func:`lightning_dist.verification.verify`).

    Args:
        steps: Optimizer steps each run trains.
        tolerance: Largest relative difference accepted; ``None``: by precision (1e-10 fp64, 1e-4 fp32, 2e-2
            mixed/half), or what the strategy states for itself (ZeRO++'s quantized communication).
        dtype: ``"float64"`` runs both sides in ``64-true`` precision, a much sharper check; ``None`` keeps the
            configuration's precision.
        against: The reference: ``"one_process"`` (one process, no DDP wrapper), ``"ddp"`` (DDP on as many
            processes as the strategy), or another registered strategy name (on as many processes).
        keep_dropout: Leave dropout on. Its random draws cannot agree between layouts, so verify sets every dropout
            probability to 0 on both sides unless told otherwise.
        workdir: Where the runs write (``None``: a new temporary folder, removed after a passing run).
        seed: The seed of both runs (the configuration's ``seed_everything`` when it gives one).
        timeout: Seconds each run may take before it is stopped and reported as hung.
        reference_cache: A folder where reference runs are kept, and reused by later checks of the same module,
            data, settings and global batch (checking several strategies then trains the reference once). Used
            only with ``anchor=False``: an anchored reference depends on the strategy's run.
        anchor: Start each of the reference's optimizer steps (and its validation) from the strategy's parameters
            and optimizer states at that point, so that each step's computation is compared rather than the
            rounding two runs accumulate over their steps (in fp32, Adam turns 1e-7 differences into 1e-4 within a
            few steps). What each step made of the state it was given is compared too: a wrong update still shows.
            ``False``: the reference trains on its own and the two trajectories are compared. Only a reference on
            unsharded processes (``one_process``, ``ddp``) can be anchored.
    """

    steps: int = 3
    tolerance: float | None = None
    dtype: str | None = None
    against: str = ONE_PROCESS
    keep_dropout: bool = False
    workdir: str | None = None
    seed: int = 0
    timeout: float = 900.0
    reference_cache: str | None = None
    anchor: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: verify needs at least one optimizer step.")
        if self.dtype not in (None, "float64", "float32"):
            raise ValueError(f"dtype={self.dtype!r}: choose float64 (both sides in 64-true) or leave it unset.")
        if self.tolerance is not None and not self.tolerance > 0:
            raise ValueError(f"tolerance={self.tolerance!r} must be a positive number.")

    @property
    def anchored(self) -> bool:
        """Whether the reference's steps start from the strategy's states (see ``anchor``)."""
        return self.anchor and self.against in (ONE_PROCESS, "ddp")

    @property
    def precision_override(self) -> str | None:
        return {"float64": "64-true", "float32": "32-true"}.get(self.dtype or "")


def default_tolerance(precision: str, strategy_tolerance: float | None = None) -> float:
    """The tolerance for a run in ``precision``: the strategy's own statement when it makes one, else by dtype."""
    by_dtype = DEFAULT_TOLERANCES.get(str(precision), LOW_PRECISION_TOLERANCE)
    return max(by_dtype, strategy_tolerance or 0.0)


def trainer_overrides(
    settings: VerifySettings, role: str, root: Path, validates: bool, accumulate: int = 1
) -> dict[str, Any]:
    """The Trainer arguments verify replaces in ``role``'s run (``validates``: the configuration validates;
    ``accumulate``: its ``accumulate_grad_batches``, since validation is placed by batches, not optimizer steps)."""
    overrides: dict[str, Any] = {
        "max_steps": settings.steps,
        "max_epochs": -1,
        "min_steps": None,
        "min_epochs": None,
        "max_time": None,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": str(root / role),
        "check_val_every_n_epoch": None,
        "val_check_interval": settings.steps * accumulate,
        "limit_val_batches": VALIDATION_BATCHES if validates else 0,
    }
    if settings.precision_override:
        overrides["precision"] = settings.precision_override
    return overrides


def reference_strategy(against: str, devices: Any, num_nodes: int) -> dict[str, Any]:
    """The Trainer arguments that make the reference's processes: ``strategy``, ``devices`` and ``num_nodes``."""
    if against == ONE_PROCESS:
        return {"strategy": ONE_PROCESS_STRATEGY, "devices": 1, "num_nodes": 1}
    return {"strategy": against, "devices": devices, "num_nodes": num_nodes}


def is_removed_callback(callback: Any) -> bool:
    """Whether verify leaves out a configured callback: checkpointing (it would write the user's files) and early
    stopping (it would end a run before the steps compared). ``callback`` is an instance or a config entry."""
    cls = type(callback)
    class_path = callback.get("class_path") if hasattr(callback, "get") else None
    if isinstance(class_path, str):
        module, _, name = class_path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module or "lightning.pytorch.callbacks"), name)
        except (ImportError, AttributeError):
            return False
    return isinstance(cls, type) and issubclass(cls, (Checkpoint, EarlyStopping))
