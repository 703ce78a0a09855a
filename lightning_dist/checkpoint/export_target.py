"""Where a command that writes a model file (``lightning-dist consolidate``, and any export) may write.

An export writes only to a path that does not exist, or over an earlier export: a file that an export marked as one
when it wrote it (:func:`mark_export` for a ``torch.save`` checkpoint, :data:`SAFETENSORS_MARKER` in a safetensors
header), or a folder an export wrote (:data:`EXPORT_FOLDER_MARKER` listing every file in it, each safetensors file
carrying the header mark). Everything else is refused by :func:`check_export_target` before anything is read or written, with the
reason:

* the checkpoint being read, a link to it, or a path inside it;
* a training checkpoint: a folder with DCP shards, a DCP index, a ``COMPLETE`` manifest or ``meta.pt`` (ours,
  Lightning's, or an unfinished save), or a single file holding Lightning's loop state or our provenance without the
  export mark. Its contents may be identical to an export's; only the mark says a tool may replace it;
* a folder holding anything an export did not write (a file of the user's beside an export's), or without the
  folder mark;
* anything else: a symbolic link, a file of any other kind.

A training run never carries the mark: a strategy writes a fresh provenance entry into every checkpoint it saves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning_dist.checkpoint.errors import CheckpointError
from lightning_dist.checkpoint.layout import (
    COMPLETE_MARKER,
    DCP_INDEX,
    METADATA_FILENAME,
    PROVENANCE_KEY,
    TMP_INFIX,
    file_size,
)
from lightning_dist.checkpoint.safe_load import probe_entries

#: The entry of our provenance that marks a ``torch.save`` export: ``{"tool": "consolidate"}``.
EXPORT_ENTRY = "export"
#: Key of the safetensors header metadata that marks our exports (value ``"consolidated"``).
SAFETENSORS_MARKER = "lightning_dist"
#: The file in an exported folder that lists the files the export wrote there (itself excepted).
EXPORT_FOLDER_MARKER = "lightning_dist_export.json"

_RULE = (
    "An export writes only to a path that does not exist or over an earlier export of lightning_dist (a file it marked"
    " as one when writing it); it never replaces a training checkpoint, its own input, or anything else."
    " Choose another path, or move what is there away yourself."
)


def check_export_target(
    out: str | os.PathLike, source: str | os.PathLike | None = None, command: str | None = None, fmt: str | None = None
) -> Path:
    """Raise :class:`CheckpointError`, before anything is written, unless an export may write ``out`` (see the module
    docstring); ``source``: the checkpoint the export reads; ``command``: the ``lightning-dist`` command writing, whose
    usage the message recalls when ``out`` is a training checkpoint (swapped arguments); ``fmt``: the format of the
    folder an export writes (``None``: one file, as ``consolidate`` writes). Outputs never replace each other: a
    file only replaces a file of ``consolidate``'s, a folder only an export folder of the same format, and nothing is
    written inside an export folder. Returns ``out`` as a path."""
    out = Path(out)
    problem = _reading(out, Path(source)) if source is not None else None
    if problem is None:
        problem = _inside_export_folder(out)
    if problem is None and (out.exists() or out.is_symlink()):
        problem = what_is_there(out) or _other_kind(out, fmt)
    if problem is not None:
        hint = ""
        if command is not None and "training checkpoint" in problem:
            hint = f" The checkpoint to read comes first: `lightning-dist {command} CHECKPOINT OUT`."
        raise CheckpointError(f"Refusing to write {str(out)!r}: {problem}. {_RULE}{hint}")
    return out


def mark_export(checkpoint: dict[str, Any], tool: str) -> dict[str, Any]:
    """``checkpoint`` with the export mark in its provenance entry (what it was saved with is kept)."""
    provenance = checkpoint.get(PROVENANCE_KEY)
    provenance = dict(provenance) if isinstance(provenance, dict) else {}
    return {**checkpoint, PROVENANCE_KEY: {**provenance, EXPORT_ENTRY: {"tool": tool}}}


def what_is_there(path: Path) -> str | None:
    """``None`` if ``path`` is an earlier export of ours, else what is there (for messages)."""
    if path.is_symlink():
        return f"it is a symbolic link (to {os.readlink(path)!r})"
    if path.is_dir():
        signs = _training_folder_signs(path)
        if signs:
            return f"it is a sharded training checkpoint (a folder with {signs})"
        if is_own_export_folder(path):
            return None
        entries = sorted(p.name for p in path.iterdir())
        if not entries:
            return "it is an empty directory"
        if EXPORT_FOLDER_MARKER in entries:
            ours = set(_listed_files(path / EXPORT_FOLDER_MARKER) or ())
            others = [name for name in entries if name not in ours and name != EXPORT_FOLDER_MARKER]
            if others:
                return f"it is an export folder holding files an export did not write ({', '.join(others[:5])})"
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        return f"it is a directory ({len(entries)} entr{'y' if len(entries) == 1 else 'ies'}: {shown})"
    if not path.is_file():
        return "it is neither a file nor a directory"
    if is_own_safetensors(path):
        return None
    entries = probe_entries(path)  # runs nothing from the file, reads no tensor
    if entries is None:
        return f"it is a file that is not an export of lightning_dist ({file_size(path)})"
    provenance = entries.get(PROVENANCE_KEY)
    if isinstance(provenance, dict) and isinstance(provenance.get(EXPORT_ENTRY), dict):
        return None
    if isinstance(provenance, dict):
        return "it is a training checkpoint (a single file with a lightning_dist provenance entry and no export mark)"
    if "loops" in entries:
        return "it is a training checkpoint (a single file with Lightning's loop state)"
    return f"it is a file that is not an export of lightning_dist ({file_size(path)})"


def _inside_export_folder(path: Path) -> str | None:
    """Why ``path`` may not be written: it is in a folder an export wrote (the folder would then hold a file it does
    not list, or one replaced by another tool's)."""
    parent = path.absolute().parent
    if is_own_export_folder(parent):
        return f"it is inside the export folder {str(parent)!r} (written by `lightning-dist export`)"
    return None


def _other_kind(path: Path, fmt: str | None) -> str | None:
    """Why the earlier export at ``path`` is not one this output may replace: another tool's, or another format's."""
    if path.is_dir():
        written = export_folder_format(path)
        if fmt is None:
            return (
                f"it is an export folder (--format {written}) written by `lightning-dist export`; this writes one file"
            )
        if written != fmt:
            what = {"hf": "a Hugging Face model folder", "peft": "a PEFT adapter folder", "litgpt": "a litgpt folder"}
            return (
                f"it is an export of another format ({what.get(written, written)}, --format {written}); an export"
                f" replaces only its own earlier output of the same format (--format {fmt})"
            )
        return None
    if fmt is not None:
        return "it is a file written by `lightning-dist consolidate`; an export writes a folder"
    return None


def export_folder_format(path: Path) -> str:
    """The format the export folder at ``path`` was written in (``"hf"`` for one written before formats were
    recorded)."""
    try:
        marker = json.loads((path / EXPORT_FOLDER_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "hf"
    fmt = marker.get("format") if isinstance(marker, dict) else None
    return fmt if isinstance(fmt, str) else "hf"


def is_export_leftover(path: Path) -> bool:
    """Whether the hidden leftover ``path`` (``.OUT.tmp-*``, ``.OUT.old-*``) is an export's: a complete export
    folder, or a temporary one holding no training checkpoint and only the kinds of files an export writes (a
    safetensors file cut short by the kill carries no mark yet)."""
    if path.is_symlink() or not path.is_dir() or _training_folder_signs(path):
        return False
    if is_own_export_folder(path):
        return True
    if TMP_INFIX not in path.name:
        return False
    return all(
        entry.is_file() and not entry.is_symlink() and entry.suffix in _EXPORT_SUFFIXES for entry in path.iterdir()
    )


#: The kinds of files an export writes.
_EXPORT_SUFFIXES = (".safetensors", ".json", ".yaml", ".pth", ".txt", ".model", ".jinja")


def mark_export_folder(folder: Path, files: list[str], fmt: str) -> None:
    """Write :data:`EXPORT_FOLDER_MARKER` into ``folder``, listing ``files`` (names inside it) as the export's."""
    marker = {"tool": "export", "format": fmt, "files": sorted(files)}
    (folder / EXPORT_FOLDER_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")


def is_own_export_folder(path: Path) -> bool:
    """Whether ``path`` is a folder an export wrote: its marker lists every other entry, each a plain file, and every
    safetensors file carries the header mark."""
    if path.is_symlink() or not path.is_dir():
        return False
    listed = _listed_files(path / EXPORT_FOLDER_MARKER)
    if listed is None:
        return False
    entries = {p.name: p for p in path.iterdir() if p.name != EXPORT_FOLDER_MARKER}
    if not set(entries) <= set(listed):
        return False
    return all(
        p.is_file() and not p.is_symlink() and (not p.name.endswith(".safetensors") or is_own_safetensors(p))
        for p in entries.values()
    )


def _listed_files(marker: Path) -> list[str] | None:
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        content = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = content.get("files") if isinstance(content, dict) else None
    return [f for f in files if isinstance(f, str)] if isinstance(files, list) else None


def is_own_safetensors(path: Path) -> bool:
    """Whether ``path`` is a safetensors file an export of ours wrote (its header metadata carries our marker)."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 100 * 2**20:
                return False
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return False
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(metadata, dict) and metadata.get(SAFETENSORS_MARKER) in _SAFETENSORS_MARKS


#: The values of :data:`SAFETENSORS_MARKER`: a consolidated file, a shard of an exported folder.
_SAFETENSORS_MARKS = ("consolidated", "exported")


def _reading(out: Path, source: Path) -> str | None:
    """Why ``out`` is (in) the checkpoint being read, if it is."""
    if not source.exists():
        return None
    real_out, real_source = os.path.realpath(out), os.path.realpath(source)
    if real_out == real_source or (out.exists() and os.path.samefile(out, source)):  # samefile: hard links
        return "it is the checkpoint being read"
    if source.is_dir() and os.path.commonpath([real_out, real_source]) == real_source:
        return "it is inside the checkpoint being read"
    return None


def _training_folder_signs(folder: Path) -> str:
    """What makes ``folder`` a training checkpoint (shards, index, manifest, ``meta.pt``), or ``""``."""
    names = {p.name for p in folder.iterdir()}
    signs = [f"{what} ({name})" for name, what in _FIXED.items() if name in names]
    shards = sorted(name for name in names if name.endswith(".distcp"))
    if shards:
        signs.insert(0, f"DCP shards ({shards[0]}{', ...' if len(shards) > 1 else ''})")
    return ", ".join(signs)


_FIXED = {DCP_INDEX: "a DCP index", COMPLETE_MARKER: "a manifest", METADATA_FILENAME: "Lightning's checkpoint entries"}
