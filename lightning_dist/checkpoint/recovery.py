"""Finishing what a save killed while publishing left behind, so that no complete checkpoint is ever lost.

A save writes under a hidden temporary name and publishes by renaming (:func:`~.layout.publish`). A process killed
after the write finished leaves a complete checkpoint under a hidden name:

* before the renames: ``.last.ckpt.tmp-<token>`` (complete) beside the previous ``last.ckpt``;
* between them: ``.last.ckpt.tmp-<token>`` (complete) and the previous version aside as ``.last.ckpt.old-<token>``,
  and no ``last.ckpt`` at all: Lightning's ``ckpt_path="last"``, which lists the folder, finds nothing;
* after them: the new ``last.ckpt`` and the previous version aside, not yet deleted.

:func:`interrupted_publish` says what is left to do for one checkpoint name and :func:`finish_publish` does it: the
newest complete version (by the time its save finished) is published under the name, and versions a publish set
aside are deleted once a newer one is in place. A complete temporary older than what stands at the name is left
alone; an unfinished write (a folder without its ``COMPLETE`` marker, a file that is not a complete zip) is deleted
only by the next save of the same name (:func:`prepare_target`). Nothing but our own hidden names, and a
checkpoint of ours at the name being replaced by a newer version of itself, is ever moved or deleted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.integrity import check_structure
from lightning_dist.checkpoint.layout import (
    COMPLETE_MARKER,
    OLD_INFIX,
    TMP_INFIX,
    discard,
    foreign_content,
    publish,
)

_LEFTOVER = re.compile(rf"^\.(?P<name>.+)(?P<infix>{re.escape(TMP_INFIX)}|{re.escape(OLD_INFIX)})[0-9a-f]+$")


@dataclass(frozen=True)
class InterruptedPublish:
    """What is left to do at ``target`` after a save was killed while publishing it."""

    target: Path
    newest: Path | None  # the newest complete version, under a hidden name, to publish at the target
    replaced: tuple[Path, ...]  # older versions a publish moved aside, to delete once the target is in place

    def describe(self) -> str:
        name = self.target.name
        if self.newest is None:
            removed = ", ".join(repr(p.name) for p in self.replaced)
            return f"deleted {removed}: older versions of {name!r} that an interrupted save had moved aside"
        if _is_temporary(self.newest):
            how = "a save that had finished writing but was stopped before it was renamed into place"
        else:
            how = "the previous version, which a stopped save had moved aside"
        return f"published {name!r} from {self.newest.name!r}: {how} (the newest complete version of {name!r})"


def leftovers(folder: Path) -> dict[str, list[Path]]:
    """Every hidden temporary or set-aside entry of a save in ``folder``, by the checkpoint name it belongs to."""
    found: dict[str, list[Path]] = {}
    try:
        entries = list(folder.iterdir())
    except OSError:
        return found
    for entry in entries:
        match = _LEFTOVER.match(entry.name)
        if match is not None:
            found.setdefault(match["name"], []).append(entry)
    return found


def is_complete_save(path: Path) -> bool:
    """Whether ``path`` (a hidden leftover, or a checkpoint) is one of our checkpoints whose write finished: a folder
    with its ``COMPLETE`` marker, or a file, carrying our provenance entry and passing the cheap structure checks."""
    try:
        if path.is_symlink() or not path.exists() or foreign_content(path) is not None:
            return False
        check_structure(path)
    except (CheckpointError, OSError):
        return False
    return True


def interrupted_publish(target: Path) -> InterruptedPublish | None:
    """What an interrupted publish of ``target`` left to do (``None``: nothing). Nothing is done over a ``target``
    that is not ours."""
    entries = leftovers(target.parent).get(target.name, [])
    if not entries:
        return None
    present = target.exists() or target.is_symlink()
    if present and foreign_content(target) is not None:
        return None
    complete = [entry for entry in entries if is_complete_save(entry)]
    if present:
        since = saved_at(target)
        complete = [entry for entry in complete if saved_at(entry) > since]
    newest = max(complete, key=lambda p: (saved_at(p), _is_temporary(p), p.name), default=None)
    in_place = present or newest is not None
    replaced = tuple(sorted(e for e in entries if in_place and not _is_temporary(e) and e != newest))
    if newest is None and not replaced:
        return None
    return InterruptedPublish(target, newest, replaced)


def interrupted_publishes(folder: Path) -> list[InterruptedPublish]:
    """:func:`interrupted_publish` of every checkpoint name in ``folder`` with leftovers."""
    items = (interrupted_publish(folder / name) for name in sorted(leftovers(folder)))
    return [item for item in items if item is not None]


def finish_publish(item: InterruptedPublish) -> None:
    """Publish the newest complete version at the target, then delete the versions set aside. Run by one process
    only (rank 0): the steps are not safe against another process doing the same at once."""
    if item.newest is not None:
        publish(item.newest, item.target)
    for old in item.replaced:
        discard(old)


def prepare_target(path: Path) -> None:
    """Before a save of ``path`` writes anything: finish what a killed save of the same name left half-published (a
    complete version is published, never deleted: see the module docstring), then delete that
    save's unfinished writes, which never look complete."""
    item = interrupted_publish(path)
    if item is not None:
        finish_publish(item)
    for leftover in unfinished_writes(path):
        discard(leftover)


def restore_missing(target: Path) -> bool:
    """If ``target`` is missing, move its newest complete version there from under a hidden name (one rename, so
    every rank may try at once: one wins). Returns whether ``target`` exists."""
    if not target.exists() and not target.is_symlink():
        item = interrupted_publish(target)
        if item is not None and item.newest is not None:
            try:
                os.replace(item.newest, target)
            except OSError:  # another rank won
                pass
    return target.exists()


def unfinished_writes(target: Path) -> list[Path]:
    """The temporaries of saves of ``target`` that never finished writing, and versions set aside whose deletion
    had begun (no ``COMPLETE`` marker left): what a new save of ``target`` deletes."""
    return [entry for entry in leftovers(target.parent).get(target.name, []) if _unfinished(entry)]


def _unfinished(entry: Path) -> bool:
    if _is_temporary(entry):
        return not is_complete_save(entry)
    return entry.is_dir() and not (entry / COMPLETE_MARKER).exists()


def saved_at(path: Path) -> float:
    """When the save of ``path`` finished: the time of its ``COMPLETE`` marker, or of the file (renames keep it)."""
    marker = path / COMPLETE_MARKER
    try:
        return (marker if path.is_dir() and marker.exists() else path).stat().st_mtime
    except OSError:
        return float("-inf")


def _is_temporary(path: Path) -> bool:
    match = _LEFTOVER.match(path.name)
    return match is not None and match["infix"] == TMP_INFIX
