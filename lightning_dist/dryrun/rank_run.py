"""One rank of a dry run: the user's configuration built as ``lightning-dist fit`` builds it, on the meta device,
then ``trainer.fit`` for one optimizer step on fake tensors and fake collectives, recorded."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Checkpoint

from lightning_dist.dryrun.fake_world import fake_rank
from lightning_dist.dryrun.scope import RankScope
from lightning_dist.lightning_cli import CLI_CLASSES, DistCLI, import_from_cwd

#: What a dry run sets on top of the user's Trainer arguments: one optimizer step on the CPU code path, nothing
#: written (no logger, no checkpoint), no validation.
DRY_RUN_TRAINER = {"accelerator": "cpu", "max_steps": 1, "limit_val_batches": 0, "num_sanity_val_steps": 0,
                   "logger": False, "enable_progress_bar": False, "enable_model_summary": False}  # fmt: skip


@dataclass(frozen=True)
class Collective:
    """One collective a rank issued: its kind, the global ranks of its group (``peer``: the other end of a send or
    receive), the bytes of its payload (the tensor this rank contributes or receives, as CommCounter's
    ``tensor_bytes``), and the phase (``launch``, ``setup``, ``prepare``, ``train``, ``step``, ``end``: see
    ``scope.RankScope.recording``)."""

    kind: str
    group: tuple[int, ...]
    bytes: int
    phase: str
    peer: int | None = None

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"kind": self.kind, "group": list(self.group), "bytes": self.bytes, "phase": self.phase}
        if self.peer is not None:
            entry["peer"] = self.peer
        return entry


@dataclass
class RankRecord:
    """What one rank did: its collectives in order, the peak memory of its training step by category (``memory``,
    measured) and of a later step, which runs with the optimizer's states (``later_step``, projected)."""

    rank: int
    role: str
    memory: dict[str, int] = field(default_factory=dict)
    later_step: dict[str, int] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    @property
    def peak_bytes(self) -> int:
        return self.memory.get("total", 0)

    @property
    def later_step_bytes(self) -> int:
        return self.later_step.get("total", 0)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "role": self.role, "memory": self.memory, "later_step": self.later_step,
                "seconds": self.seconds, "error": self.error,
                "collectives": [c.to_json() for c in self.collectives]}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankRecord:
        collectives = [
            Collective(c["kind"], tuple(c["group"]), c["bytes"], c["phase"], c.get("peer")) for c in data["collectives"]
        ]
        return cls(data["rank"], data["role"], data["memory"], data.get("later_step", {}), collectives, data["seconds"],
                   data["error"])  # fmt: skip


class DryRunCLI(DistCLI):
    """``lightning-dist fit``'s CLI that always builds the model on the meta device."""

    def builds_model_on_meta_device(self) -> bool:
        return True


def build_trainer(cli_args: list[str], world_size: int, num_nodes: int, steps: int = 1) -> DryRunCLI:
    """The configuration of ``cli_args`` (``fit``'s arguments) for one rank of ``world_size``, not yet fitted, to
    train ``steps`` optimizer steps."""
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    import_from_cwd()
    overrides = {**DRY_RUN_TRAINER, "max_steps": steps, "devices": world_size // num_nodes, "num_nodes": num_nodes}
    args = [*cli_args, *(f"--trainer.{key}={_yaml(value)}" for key, value in overrides.items())]
    cli = DryRunCLI(**CLI_CLASSES, args=args, run=False, save_config_callback=None)
    trainer = cli.trainer
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, Checkpoint)]  # nothing is written
    return cli


def check_before_ranks(strategy: Any, trainer: Any, model: Any, datamodule: Any) -> None:
    """The strategy's checks of the model and the first batch against its mesh, as ``fit`` makes them before launch
    (each parallelism's checks of the first batch around the model's), on the model connected to ``strategy``."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lightning.pytorch.trainer.states import TrainerFn

    arguments = {"model": model, "datamodule": datamodule, "ckpt_path": None}
    strategy.rehearses_launch, trainer.state.fn = True, TrainerFn.FITTING  # as fit's launching process checks
    parts = strategy.step_parts()
    for part in parts:
        part.preflight_before_model(trainer, arguments)
    if not is_overridden("configure_model", model, LightningModule):
        strategy.check_model(model)
    for part in parts:
        part.preflight_after_model(trainer, arguments)


def run_rank(
    cli_args: list[str],
    rank: int,
    role: str,
    world_size: int,
    num_nodes: int,
    mailbox: Path | None = None,
    peers: Sequence[int] = (),
) -> RankRecord:
    """Dry-run global rank ``rank``: its setup and one optimizer step, recorded."""
    start = time.perf_counter()
    record = RankRecord(rank, role)
    with quiet(), fake_rank(rank, world_size, world_size // num_nodes, mailbox, peers):
        cli = build_trainer(cli_args, world_size, num_nodes)
        strategy = cli.trainer.strategy
        if getattr(strategy, "initial_weights", None) is not None:
            strategy.initial_weights = None  # a dry run reads no weights
        scope = RankScope()
        scope.install(cli.trainer, cli.model)
        with scope.recording():
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    record.memory, record.later_step = scope.memory_peak, scope.later_peak
    # the root of a broadcast is left out: a dry-run rank sends its own (see fake_world)
    record.collectives = [
        Collective(r.op, tuple(r.group_ranks), r.tensor_bytes, r.phase, r.peer if r.op in ("send", "recv") else None)
        for r in scope.collectives
    ]
    record.seconds = time.perf_counter() - start
    return record


@contextmanager
def quiet() -> Iterator[None]:
    """Lightning's and the strategy's log lines and warnings, once per rank, are left out of a dry run's output."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "lightning_dist")]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
