"""torchft, the optional library behind ``fault_tolerance=...`` (``pip install 'lightning-dist[ft]'``): every torchft
name lightning_dist uses, imported here only and lazily (never when lightning_dist is imported), with the version it
was checked on.

torchft 0.2.0 pins a CUDA build of torch: install it with ``pip install --no-deps torchft==0.2.0`` after torch, plus
the ``opentelemetry-*`` packages it imports (the ``[ft]`` extra lists them). No private torchft name is used.
"""

from __future__ import annotations

import importlib
import logging
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

#: The torchft version the fault-tolerance code was tested with.
TESTED_TORCHFT = "0.2.0"
INSTALL_LINE = (
    "pip install 'lightning-dist[ft]'  (torchft pins a CUDA torch: on a CPU build install it with"
    " `pip install --no-deps torchft==0.2.0` and `pip install opentelemetry-api opentelemetry-sdk"
    " opentelemetry-exporter-otlp-proto-http`)"
)


class TorchftMissingError(ImportError):
    """torchft is not installed (or cannot be imported) but ``fault_tolerance`` needs it."""


def torchft_version() -> str | None:
    """The installed torchft version, or ``None`` when torchft is not installed."""
    try:
        return version("torchft")
    except PackageNotFoundError:
        return None


class _NoFlightRecorderWarning(logging.Filter):
    """torchft warns at every new quorum that it cannot reset NCCL's flight recorder, even on gloo."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "flight recorder" not in record.getMessage()


def _import(module: str) -> Any:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    manager_logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NoFlightRecorderWarning) for f in manager_logger.filters):
        manager_logger.addFilter(_NoFlightRecorderWarning())
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise TorchftMissingError(
            f"fault_tolerance needs torchft {TESTED_TORCHFT}, which could not be imported ({err}). Install it with:"
            f" {INSTALL_LINE}"
        ) from err


def manager_class() -> type:
    """``torchft.Manager``: the quorum, the step commit and healing of one replica group (checked on 0.2.0)."""
    return _import("torchft.manager").Manager


def reconfigurable_process_group(backend: str, timeout_s: float) -> Any:
    """torchft's reconfigurable process group across replica groups for ``backend`` (``"gloo"`` or ``"nccl"``),
    with ``timeout_s`` per collective. ``ProcessGroupBabyGloo`` (a subprocess per group) failed on the CPU build."""
    from datetime import timedelta

    process_group = _import("torchft.process_group")
    kind = process_group.ProcessGroupNCCL if backend == "nccl" else process_group.ProcessGroupGloo
    return kind(timeout=timedelta(seconds=timeout_s))


def lighthouse_server(
    bind: str, min_replicas: int, join_timeout_ms: int, quorum_tick_ms: int, heartbeat_timeout_ms: int
) -> Any:
    """An in-process torchft lighthouse (``.address()``, ``.shutdown()``), as the ``torchft_lighthouse`` console
    script starts one."""
    coordination = _import("torchft.coordination")
    return coordination.LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
