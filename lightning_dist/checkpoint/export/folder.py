"""Writing an export folder: everything goes into a hidden temporary folder beside ``OUT``, which is marked as an
export (the files it holds listed) and published in place of ``OUT`` only when complete, so a crash never leaves
something that looks finished; what it replaces was checked to be an earlier export of ours of the same format.

An export killed part way leaves hidden folders beside ``OUT``: its temporary one (``.OUT.tmp-<token>``, finished or
not) and, when killed while publishing, the previous export set aside (``.OUT.old-<token>``), with no ``OUT`` at all
between the two renames. The next export to ``OUT`` first finishes that (:func:`finish_interrupted_export`): the
newest complete export is put back at ``OUT`` if nothing is there, and the rest is deleted, so a re-run leaves one
complete ``OUT`` and nothing hidden. Only folders under those hidden names that hold an export's files are touched;
one export at a time writes to a given ``OUT``."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.export_target import (
    check_export_target,
    is_export_leftover,
    is_own_export_folder,
    mark_export_folder,
)
from lightning_dist.checkpoint.layout import discard, new_token, publish, temporary_path
from lightning_dist.checkpoint.recovery import leftovers
from lightning_dist.checkpoint.save_failures import save_failure


def write_export_folder(
    out: str | Path, source: str | Path, fmt: str, write: Callable[[Path], list[str]], command: str = "export"
) -> Path:
    """Publish at ``out`` the folder that ``write(folder)`` fills (it returns the names of the files it wrote)."""
    out = check_export_target(out, source, command=command, fmt=fmt)
    tmp = temporary_path(out, new_token())
    try:
        tmp.mkdir(parents=True)
        files = write(tmp)
        mark_export_folder(tmp, files, fmt)
        check_export_target(out, source, command=command, fmt=fmt)  # still free, or still ours, just before the swap
        publish(tmp, out)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as err:
        raise save_failure(out, err, tmp) from err
    return out


def finish_interrupted_export(out: Path) -> list[str]:
    """Finish what killed exports to ``out`` left (see the module docstring); returns a sentence per thing done."""
    entries = [entry for entry in leftovers(out.parent).get(out.name, []) if is_export_leftover(entry)]
    done = []
    if not (out.exists() or out.is_symlink()):
        complete = [entry for entry in entries if is_own_export_folder(entry)]
        if complete:
            newest = max(complete, key=lambda entry: (entry.stat().st_mtime, entry.name))
            os.replace(newest, out)
            entries.remove(newest)
            done.append(f"put back {out.name!r} from {newest.name!r}, left by an export killed while publishing")
    for entry in entries:
        if discard(entry):
            done.append(f"deleted {entry.name!r}, left by an export that was killed")
    return done
