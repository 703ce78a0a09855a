"""Progress of the long commands (``dryrun``, ``export``, ``consolidate``) and of reading ``initial_weights``: a
bar with the look of Lightning's own (rich's when rich is installed, as Lightning's ``RichProgressBar``; tqdm's
otherwise) on a terminal; one plain line per update (at most one a second) when the output is a pipe or a file, so
logs stay readable; nothing with ``quiet``. Progress goes to stderr: stdout keeps the command's result.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from types import TracebackType
from typing import IO, Any

from typing_extensions import Self

#: Seconds between two plain lines (the last one is always written).
LINE_INTERVAL = 1.0


class Progress:
    """``done`` of ``total`` (bytes when ``unit="B"``, else counted things), shown as the module docstring says.

    Use as a context manager: ``with Progress(total, "export") as progress: progress.update(n)``."""

    def __init__(
        self, total: int, description: str, unit: str = "B", quiet: bool = False, stream: IO[str] | None = None
    ) -> None:
        self.total, self.description, self.unit, self.quiet = max(int(total), 0), description, unit, quiet
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self._start = time.monotonic()
        self._last_line = float("-inf")
        self._bar: Any = None
        if not quiet and _is_terminal(self.stream):
            self._bar = _terminal_bar(self.total, description, unit, self.stream)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def update(self, amount: int) -> None:
        """``amount`` more done."""
        self.done += int(amount)
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(int(amount))
            return
        now = time.monotonic()
        if now - self._last_line >= LINE_INTERVAL or self.done >= self.total:
            self._last_line = now
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def line(self) -> str:
        """``export: 120.0 MiB of 480.0 MiB (25%), 3 s, about 9 s left``."""
        elapsed = time.monotonic() - self._start
        share = self.done / self.total if self.total else 1.0
        left = f", about {elapsed * (1 - share) / share:.0f} s left" if 0 < share < 1 else ""
        amount = f"{_amount(self.done, self.unit)} of {_amount(self.total, self.unit)}"
        return f"{self.description}: {amount} ({share:.0%}), {elapsed:.0f} s{left}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _amount(value: int, unit: str) -> str:
    if unit != "B":
        return f"{value:,} {unit}"
    return f"{value / 2**20:.1f} MiB" if value < 2**30 else f"{value / 2**30:.2f} GiB"


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _terminal_bar(total: int, description: str, unit: str, stream: IO[str]) -> Any:
    if importlib.util.find_spec("rich") is not None:
        return _RichBar(total, description, unit, stream)
    from tqdm import tqdm

    scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
    return tqdm(total=total, desc=description, unit=unit, file=stream, dynamic_ncols=True, **scale)


class _RichBar:
    """rich's bar, with the columns Lightning's ``RichProgressBar`` shows (bar, done/total, elapsed, remaining)."""

    def __init__(self, total: int, description: str, unit: str, stream: IO[str]) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        amount = DownloadColumn(binary_units=True) if unit == "B" else MofNCompleteColumn()
        columns = (TextColumn("{task.description}"), BarColumn(), amount, TimeElapsedColumn(), TimeRemainingColumn())
        self._progress = Progress(*columns, console=Console(file=stream), transient=False)
        self._progress.start()
        self._task = self._progress.add_task(description, total=total)

    def update(self, amount: int) -> None:
        self._progress.advance(self._task, amount)

    def close(self) -> None:
        self._progress.stop()
