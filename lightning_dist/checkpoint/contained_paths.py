"""Every file a checkpoint folder names lies inside that folder.

A sharded checkpoint names its files in its DCP index (each item's ``relative_path``) and in its ``COMPLETE``
manifest, and has files of fixed names (``meta.pt``, ``.metadata``, ``COMPLETE``). torch's ``FileSystemReader`` joins
the index's paths to the folder as they are, so an index naming ``../other/x.distcp`` or ``/home/me/x.distcp``, or a
shard that is a symbolic link, makes a shared checkpoint read any torch-format file its user can. Every reader of the
package asks :func:`checkpoint_file` for the path of a file a checkpoint names; it refuses:

* a name that is not a plain relative path: absolute, with a drive, with a ``..`` component, empty;
* a name that leads outside the folder once symbolic links are followed (links inside the folder to its own files,
  and a link *to* the checkpoint folder, such as Lightning's ``save_last="link"``, are fine).

The refusal names the checkpoint and the entry, and nothing else: it is decided from the names and links alone, before
any file they lead to is opened or measured, so its words are the same whether or not such a file exists.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePath

from lightning_dist.checkpoint.errors import CheckpointError

_REFUSED = (
    "lightning_dist reads only files inside a checkpoint's folder; a checkpoint that points elsewhere was crafted or"
    " damaged, and is refused."
)
_LINK_ADVICE = (
    "If you trust the checkpoint, copy it with its links replaced by the files they point to (`cp -rL SOURCE COPY`)"
    " and load the copy."
)


def checkpoint_file(folder: str | os.PathLike, name: object, named_in: str | None = None) -> Path:
    """``folder / name``, after checking that it lies inside ``folder`` (see the module docstring); a
    :class:`CheckpointError` naming the entry otherwise. ``named_in``: where the checkpoint names it ("its DCP
    index", "its COMPLETE manifest"), for the message; ``None`` for a file of fixed name."""
    folder = Path(folder)
    text = _as_text(folder, name, named_in)
    names = f"{named_in} names {_shown(text)}" if named_in else f"its file {_shown(text)}"
    pure = PurePath(text)
    if pure.is_absolute() or pure.drive or pure.root:
        raise _outside(folder, f"{names}, an absolute path outside the checkpoint folder. {_REFUSED}")
    if ".." in pure.parts:
        raise _outside(folder, f"{names}, a path outside the checkpoint folder ('..' leads out of it). {_REFUSED}")
    if not pure.parts:
        raise _outside(folder, f"{names}, which is not a file name: the checkpoint is damaged.")
    path = folder / pure
    root = os.path.realpath(folder)
    if not _inside(root, os.path.realpath(path)):
        # The link's own text is part of the checkpoint when the link lies in it; a link met further on is not.
        shown = _inside(root, os.path.realpath(path.parent), or_root=True) and os.path.islink(path)
        link = f" (to {_shown(os.readlink(path))})" if shown else ""
        which = f"{_shown(text)}, named by {named_in}," if named_in else f"its file {_shown(text)}"
        raise _outside(
            folder,
            f"{which} leads outside the checkpoint folder through a symbolic link{link}. {_REFUSED} {_LINK_ADVICE}",
        )
    return path


def check_contained(folder: str | os.PathLike, names: Iterable[object], named_in: str) -> None:
    """:func:`checkpoint_file` for each of ``names``."""
    for name in names:
        checkpoint_file(folder, name, named_in)


def _inside(root: str, real: str, or_root: bool = False) -> bool:
    try:
        return (or_root or real != root) and os.path.commonpath([root, real]) == root
    except ValueError:  # another drive (Windows)
        return False


def _as_text(folder: Path, name: object, named_in: str | None) -> str:
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if not isinstance(name, str) or "\0" in name:
        what = "a name with a NUL character" if isinstance(name, str) else f"a value of type {type(name).__name__}"
        raise _outside(
            folder, f"{named_in or 'it'} names a file by {what}, not a relative path: the checkpoint is damaged."
        )
    return name


def _shown(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _outside(folder: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"The checkpoint {str(folder)!r} is refused: {problem}")
