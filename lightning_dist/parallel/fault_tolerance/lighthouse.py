"""Reaching the torchft lighthouse: a check that it answers (before launch, within the connect timeout), and the
error that says where it was looked for and how to start one."""

from __future__ import annotations

import urllib.error
import urllib.request

START_HINT = (
    "Start one lighthouse for all replica groups before their jobs, on a host every group can reach:"
    " `RUST_LOG=warn torchft_lighthouse --min_replicas 1 --bind [::]:29510 --join_timeout_ms 10000` (torchft's"
    " console script), then pass lighthouse='http://<that host>:29510' (or set TORCHFT_LIGHTHOUSE) in every group."
)


class LighthouseUnreachableError(RuntimeError):
    """The torchft lighthouse did not answer within the connect timeout."""


def unreachable_message(address: str, timeout: float, cause: object) -> str:
    return (
        f"fault_tolerance: the torchft lighthouse at {address} did not answer within {timeout:g} s ({cause})."
        f" {START_HINT}"
    )


def check_lighthouse(address: str, timeout: float) -> None:
    """Raise :class:`LighthouseUnreachableError` unless the lighthouse at ``address`` answers its ``/status`` page
    within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/status", timeout=timeout) as response:
            response.read(1)
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise LighthouseUnreachableError(unreachable_message(address, timeout, reason)) from None
