"""A save that fails (a full disk, no permission, an I/O error): its partial files removed and one clear error.

torch reports a full disk while writing a zip record as ``[enforce fail at inline_container.cc:672] unexpected pos
704 vs 598``, and DCP wraps every rank's failure into a ``CheckpointException`` (a ``BaseException``) whose text is
a traceback per rank. :func:`save_failure` finds the operating system's reason (an ``OSError`` anywhere in the chain
of causes, on any rank; failing that, a file system with next to no free space) and says it in the first line,
with the path of the checkpoint.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.layout import discard

#: Below this many free bytes, a write that failed without saying why is taken to have filled the file system.
NEARLY_FULL_BYTES = 1 << 20

_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for the file system or the process's file size limit",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "input/output error",
}
_ADVICE = {
    errno.ENOSPC: "Free space there (or keep fewer checkpoints: ModelCheckpoint(save_top_k=...)), or save elsewhere.",
    errno.EDQUOT: "Free space within your quota (or keep fewer checkpoints), or save elsewhere.",
    errno.EACCES: "Make the folder writable by the user the training runs as, or save elsewhere.",
    errno.EPERM: "Make the folder writable by the user the training runs as, or save elsewhere.",
    errno.EROFS: "Save to a writable file system.",
    errno.EIO: "The storage reported an error: check it before saving there again.",
}


def save_failure(path: Path, error: BaseException, partial: Path | None = None) -> CheckpointError:
    """The error for a save of ``path`` that failed with ``error``, after removing ``partial`` (its temporary file
    or folder, if given: call this only once no rank writes there any more). Its first line names the path and
    the cause; the previous checkpoint at ``path`` was never touched, since nothing is published before it is
    complete."""
    cause, advice = describe_cause(error, path.parent)
    lines = [f"Saving the checkpoint {str(path)!r} failed: {cause}."]
    if partial is not None and (partial.exists() or partial.is_symlink()):
        if discard(partial):
            lines.append("Its partial files were removed; any previous checkpoint at that path is untouched.")
        else:
            lines.append(f"Its partial files could not all be removed: delete {str(partial)!r} yourself.")
    else:
        lines.append("Any previous checkpoint at that path is untouched.")
    if advice:
        lines.append(advice)
    lines.append(f"Details: {details(error)}")
    return CheckpointError("\n".join(lines))


def describe_cause(error: BaseException, folder: Path | None = None) -> tuple[str, str]:
    """The reason a write failed, in words, and what to do about it. ``folder``: where the save was writing (its
    free space is reported for a full disk, and a nearly full one is taken to be the cause of a failure that says
    nothing better)."""
    os_error = next((e for e in causes(error) if isinstance(e, OSError) and e.errno), None)
    free = free_bytes(folder) if folder is not None else None
    if os_error is not None:
        code = os_error.errno
        reason = _REASONS.get(code) or os.strerror(code).lower()
        if code in (errno.ENOSPC, errno.EDQUOT) and free is not None:
            reason += f" ({_amount(free)} free on the file system of {str(folder)!r})"
        elif os_error.filename:
            reason += f" ({os_error.filename!s})"
        return reason, _ADVICE.get(code, "")
    if free is not None and free < NEARLY_FULL_BYTES:
        full = f"no space left on device ({_amount(free)} free on the file system of {str(folder)!r})"
        return full, _ADVICE[errno.ENOSPC]
    first = causes(error)[-1]
    return _one_line(first), ""


def causes(error: BaseException) -> list[BaseException]:
    """``error`` and every exception behind it: explicit causes, the exception being handled when it was raised,
    and, for DCP's ``CheckpointException``, each rank's failure (outermost first)."""
    seen: list[BaseException] = []
    pending = [error]
    while pending:
        current = pending.pop(0)
        if any(current is s for s in seen):
            continue
        seen.append(current)
        pending.extend(_inner(current))
    return seen


def details(error: BaseException) -> str:
    """One line per failing rank for DCP's exception, else the error and its causes in one line."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {_chain(failure[0])}" for rank, failure in sorted(error.failures.items()))
    return _chain(error)


def _chain(error: BaseException) -> str:
    return " <- ".join(dict.fromkeys(_one_line(e) for e in causes(error)))


def free_bytes(folder: Path) -> int | None:
    """Bytes an unprivileged user may still write on the file system of ``folder`` (or of its nearest existing
    parent); ``None`` if that cannot be told."""
    for candidate in (folder, *folder.parents):
        try:
            stats = os.statvfs(candidate)
        except OSError:
            continue
        return stats.f_bavail * stats.f_frsize
    return None


def _inner(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, CheckpointException):
        for _, failure in sorted(error.failures.items()):
            yield failure[0]
    for inner in (error.__cause__, error.__context__):
        if inner is not None:
            yield inner


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def _amount(size: int) -> str:
    if size < 1024:
        return f"{size} bytes"
    if size < 1 << 20:
        return f"{size / 1024:.1f} KiB"
    return f"{size / (1 << 20):.1f} MiB" if size < 1 << 30 else f"{size / (1 << 30):.1f} GiB"
