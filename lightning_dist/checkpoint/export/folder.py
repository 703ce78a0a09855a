"""Writing an export folder: everything goes into a hidden temporary folder beside ``OUT``, which is marked as an
export (the files it holds listed) and published in place of ``OUT`` only when complete, so a crash never leaves
something that looks finished; what it replaces was checked to be an earlier export of ours."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.export_target import check_export_target, mark_export_folder
from lightning_dist.checkpoint.layout import new_token, publish, temporary_path
from lightning_dist.checkpoint.save_failures import save_failure


def write_export_folder(out: str | Path, source: str | Path, fmt: str, write: Callable[[Path], list[str]]) -> Path:
    """Publish at ``out`` the folder that ``write(folder)`` fills (it returns the names of the files it wrote)."""
    out = check_export_target(out, source, command="export")
    tmp = temporary_path(out, new_token())
    try:
        tmp.mkdir(parents=True)
        files = write(tmp)
        mark_export_folder(tmp, files, fmt)
        check_export_target(out, source, command="export")  # still free, or still ours, just before the swap
        publish(tmp, out)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as err:
        raise save_failure(out, err, tmp) from err
    return out
