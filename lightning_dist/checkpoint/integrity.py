"""Is a checkpoint intact? Checksums recorded while a save writes its files, and checks before anything reads them.

* Sharded folders: every rank's DCP writer computes a CRC-32 of each file as its bytes go out
  (:class:`ChecksummingFileSystem`); rank 0 adds ``meta.pt`` and writes the table, with each file's size, into the
  ``COMPLETE`` marker, which is written last (:func:`write_marker`). A marker of an older version (``ok``) or a
  Lightning folder (no marker) has no table: their files are checked against the sizes the DCP index implies.
* Single files: ``torch.save`` writes a zip whose directory holds a CRC-32 of every record (a saver of ours makes
  sure torch computes them, :func:`crc32_enabled`); nothing else is needed.

Two levels of checks, both raising :class:`CheckpointError` naming the file and what is wrong:

* :func:`check_structure` (cheap, before launch): every file exists with its recorded size, the small ones
  (``meta.pt``, the DCP index) match their checksums, the DCP index reads, a single file is a complete zip.
* :func:`verify_checksums` (reads every byte once, split over the ranks): every file, or zip record, matches its
  recorded checksum; :func:`checksums_verified_while_read` does it beside DCP's load, which reads the same bytes
  (a resume: one pass over the disk, refused before anything loaded is used).
"""

from __future__ import annotations

import io
import json
import mmap
import os
import struct
import threading
import zipfile
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from lightning_dist.checkpoint.contained_paths import check_contained, checkpoint_file
from lightning_dist.checkpoint.layout import COMPLETE_MARKER, DCP_INDEX, METADATA_FILENAME, CheckpointError
from lightning_dist.checkpoint.safe_load import check_index_files, dcp_reader

_CHUNK = 4 * 2**20
_MAPPED_CHUNK = 64 * 2**20  # the CRC is a C call per chunk (the GIL released in it)

try:  # the same CRC-32 as zlib's, vectorized (zlib-ng releases the GIL as zlib does)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover (a dependency; zlib when a platform has no wheel)
    from zlib import crc32
#: Files at most this large are checked against their checksum by the cheap :func:`check_structure`.
_SMALL_FILE = 16 * 2**20
_ADVICE = "Resume from another checkpoint (an earlier one, or an intact copy of this one)."


@dataclass(frozen=True)
class FileRecord:
    """What the save wrote to one file: its size and the CRC-32 of its bytes."""

    size: int
    crc32: int


@dataclass(frozen=True)
class IntegrityReport:
    """What :func:`verify_checksums` checked (for ``lightning-dist inspect``)."""

    files: int
    checksums: int  # files or zip records compared with a recorded checksum

    def describe(self) -> str:
        files = f"{self.files} file{'s' if self.files != 1 else ''}"
        if self.checksums == 0:
            return f"integrity: {files} present with the expected sizes; no checksums recorded (an older save)"
        return f"integrity: {files}, {self.checksums} checksum{'s' if self.checksums != 1 else ''} verified"


def damaged(checkpoint: Path, file: str | Path, problem: str, advice: str = _ADVICE) -> CheckpointError:
    """The error for a damaged ``file`` of a sharded ``checkpoint``, or for a damaged single-file ``checkpoint``
    (``file`` is then the checkpoint itself)."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        return CheckpointError(f"The checkpoint file {str(checkpoint)!r} {problem}. {advice}")
    return CheckpointError(
        f"The checkpoint {str(checkpoint)!r} is damaged: {str(checkpoint / file)!r} {problem}. {advice}"
    )


# ------------------------------------------------------------------------------------------------------------ saving
class _ChecksummingStream:
    """A binary file being written, with a running CRC-32 and size of what went through it."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.crc32 = 0
        self.size = 0
        self.error: OSError | None = None  # what the operating system said when a write failed

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc32 = crc32(view, self.crc32)
        self.size += view.nbytes
        try:
            return self._raw.write(view)
        except OSError as err:
            self.error = err
            raise

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close...
        return getattr(self._raw, name)


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording a :class:`FileRecord` of every file written through it (by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, FileRecord] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _ChecksummingStream(raw)
            try:
                yield stream  # type: ignore[misc]
            except Exception as err:
                # torch's zip writer turns the OSError (a full disk) into "unexpected pos 704 vs 598", and DCP sends
                # failures to rank 0 pickled, without their causes: raise the OSError itself, which keeps its errno.
                if stream.error is not None and stream.error is not err:
                    raise stream.error from err
                raise
        with self._lock:
            self.records[Path(path).name] = FileRecord(stream.size, stream.crc32)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes its index as `.metadata.tmp`, then renames it
        with self._lock:
            if (record := self.records.pop(Path(path).name, None)) is not None:
                self.records[Path(new_path).name] = record


def checksumming_writer(folder: Path, **options: Any) -> FileSystemWriter:
    """A DCP writer into ``folder`` (``options``: those of ``FileSystemWriter``) that records the checksum of each
    file it writes (:func:`records_of`)."""
    writer = FileSystemWriter(folder, **options)
    writer.fs = ChecksummingFileSystem()
    return writer


def records_of(writer: Any) -> dict[str, FileRecord]:
    """The files ``writer`` wrote on this rank (none if it is not a :func:`checksumming_writer`)."""
    return dict(getattr(getattr(writer, "fs", None), "records", {}))


def gather_records(local: dict[str, FileRecord], group: dist.ProcessGroup | None = None) -> dict[str, FileRecord]:
    """Every rank's records, merged. Collective over ``group`` when a process group is initialized."""
    if not dist.is_initialized():
        return dict(local)
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return {name: record for part in parts for name, record in (part or {}).items()}


def record_of_bytes(data: bytes) -> FileRecord:
    return FileRecord(len(data), crc32(data))


def write_marker(folder: Path, records: dict[str, FileRecord]) -> None:
    """Write the ``COMPLETE`` marker with the checksum table (the last file a save writes)."""
    files = {name: {"bytes": r.size, "crc32": f"{r.crc32:08x}"} for name, r in sorted(records.items())}
    content = {"complete": True, "checksum": "crc32", "files": files}
    (folder / COMPLETE_MARKER).write_text(json.dumps(content, indent=1) + "\n")


def read_marker(folder: Path) -> dict[str, FileRecord] | None:
    """The checksum table of a sharded checkpoint; ``None`` when it has none (a Lightning folder, or an older save
    whose marker says ``ok``). Every file it names is checked to lie inside ``folder``."""
    marker = checkpoint_file(folder, COMPLETE_MARKER)
    if not marker.is_file():
        return None
    try:
        text = marker.read_text()
        if text.strip() == "ok":
            return None
        files = json.loads(text)["files"]
        records = {name: FileRecord(int(r["bytes"]), int(r["crc32"], 16)) for name, r in files.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise damaged(folder, COMPLETE_MARKER, f"(the completion marker) cannot be read: {type(err).__name__}") from err
    check_contained(folder, records, f"its {COMPLETE_MARKER} manifest")
    return records


@contextmanager
def crc32_enabled() -> Iterator[None]:
    """``torch.save`` computing the CRC-32 of every zip record (its default, which a user may have turned off)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


# ----------------------------------------------------------------------------------------------------- cheap checks
def check_structure(path: Path, weights_only: bool = True) -> None:
    """Cheap checks of a finished checkpoint (folder or file): see the module docstring. ``weights_only``: read the
    DCP index with the restricted unpickler."""
    if path.is_dir():
        _check_folder(path, weights_only)
    else:
        _zip_records(path)


def _check_folder(folder: Path, weights_only: bool) -> None:
    records = read_marker(folder) or {}
    for name, record in records.items():
        file = folder / name
        if not file.is_file():
            raise damaged(folder, name, f"is missing (the save wrote {record.size:,} bytes there)")
        size = file.stat().st_size
        if size != record.size:
            how = "cut short or replaced" if size < record.size else "appended to or replaced"
            raise damaged(folder, name, f"has {size:,} bytes but the save wrote {record.size:,} ({how} since)")
        if not name.endswith(".distcp") and record.size <= _SMALL_FILE:
            _compare(folder, name, record)
    for name, end in _index_extents(folder, weights_only).items():
        file = folder / name
        if not file.is_file():
            raise damaged(folder, name, f"is missing (the DCP index places {end:,} bytes of tensors there)")
        if (size := file.stat().st_size) < end:
            raise damaged(
                folder, name, f"has {size:,} bytes but the DCP index places data up to byte {end:,} (truncated)"
            )


def _index_extents(folder: Path, weights_only: bool) -> dict[str, int]:
    """For each shard file the DCP index names, the end of its last item (each file checked to lie inside
    ``folder``)."""
    try:
        metadata = dcp_reader(folder, weights_only).read_metadata()
    except CheckpointError:
        raise
    except Exception as err:
        raise damaged(
            folder, DCP_INDEX, f"(the DCP index) cannot be read: {type(err).__name__}: {str(err).rstrip('.')}"
        ) from err
    check_index_files(folder, metadata)
    extents: dict[str, int] = {}
    try:
        for info in metadata.storage_data.values():
            extents[info.relative_path] = max(extents.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except (AttributeError, TypeError, ValueError) as err:
        raise damaged(folder, DCP_INDEX, f"(the DCP index) holds a malformed file position: {err}") from err
    return extents


@dataclass(frozen=True)
class _ZipRecord:
    name: str
    offset: int  # of the local header
    size: int
    crc32: int


def _zip_records(file: Path) -> list[_ZipRecord]:
    """The records of a single-file (``torch.save`` zip) checkpoint; a clear error if it is not one."""
    try:
        with zipfile.ZipFile(file) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        with file.open("rb") as f:
            start = f.read(16)
        if start.startswith(b"PK\x03\x04"):
            raise damaged(file, file, f"is cut short or damaged: its zip directory cannot be read ({err})") from err
        if start.startswith(b"\x80"):  # torch.save's legacy (non-zip) format: nothing to check here
            return []
        problem = f"cannot be read as a torch checkpoint: it is not a torch.save file (it starts with {start!r})"
        raise damaged(file, file, problem, advice="Is this the path you meant?") from err
    size = file.stat().st_size
    # Record names start with the archive's own folder (the temporary name it was saved under): shown without it.
    records = [_ZipRecord(i.filename.split("/", 1)[-1], i.header_offset, i.compress_size, i.CRC) for i in infos]
    for record in records:
        if record.offset + record.size > size:
            raise damaged(file, file, f"is cut short: record {record.name!r} ends past its {size:,} bytes")
    return records


def file_crc32(path: Path) -> int:
    """The CRC-32 of a whole file, by zlib-ng's vectorized CRC when installed (5x zlib's on one core: 10.5 against
    2.1 GB/s measured; the same value as ``zlib.crc32``), over the file mapped into memory: the page cache's pages
    are read where they are, not copied into a buffer first (0.09 s against 0.16 s for 1 GiB)."""
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # a file system that cannot map files: read it
            return _read_crc32(f)
        with mapped, memoryview(mapped) as view:
            crc = 0
            for start in range(0, size, _MAPPED_CHUNK):
                with view[start : start + _MAPPED_CHUNK] as chunk:
                    crc = crc32(chunk, crc)
            return crc


def _read_crc32(f: Any) -> int:
    crc = 0
    buffer = bytearray(_CHUNK)
    with memoryview(buffer) as view:
        while read := f.readinto(buffer):
            crc = crc32(view[:read], crc)
    return crc


# ---------------------------------------------------------------------------------------------------- full checks
def verify_checksums(path: Path, weights_only: bool = True, alone: bool = False) -> IntegrityReport:
    """Compare every recorded checksum with the bytes on disk (after :func:`check_structure`). When a process group
    is initialized the files are split over the ranks and every rank raises the same error. Collective then, unless
    ``alone`` (one process reads everything: an export run by one rank of a job)."""
    checks, files = _checks(path, weights_only)
    rank, world = _share(alone)
    _raise_on_every_rank(_first_problem(path, checks[rank::world]), world)
    return IntegrityReport(files=files, checksums=len(checks))


@contextmanager
def checksums_verified_while_read(path: Path, weights_only: bool = True) -> Iterator[None]:
    """:func:`verify_checksums` of the sharded folder ``path``, in a thread beside the block, which reads the same
    files (DCP's load): the bytes come from the disk once, and the checksums cost what the block leaves of the
    processors (the CRC releases the GIL). Every rank raises the same error when the block ends, before the
    caller uses anything it loaded; when the block itself fails, a damaged file this rank found is the error.
    Collective."""
    checks, _ = _checks(path, weights_only)
    rank, world = _share(False)
    found: list[str | None] = [None]

    def verify() -> None:
        try:
            found[0] = _first_problem(path, checks[rank::world])
        except Exception as error:  # noqa: BLE001 (reported as the checkpoint's problem when the block ends)
            found[0] = f"Could not verify the checksums of {str(path)!r}: {error}"

    thread = threading.Thread(target=verify, name="lightning_dist-checksums", daemon=True)
    thread.start()
    try:
        yield
    except BaseException as error:
        thread.join()
        if isinstance(error, CheckpointException):  # DCP raised it on every rank: they can agree on the cause
            _raise_on_every_rank(found[0], world)
        if found[0] is not None:  # the read failed on a damaged file: that is the cause to report
            raise CheckpointError(found[0]) from None
        raise
    thread.join()
    _raise_on_every_rank(found[0], world)


def _checks(path: Path, weights_only: bool) -> tuple[list[tuple[str, Any]], int]:
    """The checksums to compare (``(file or record name, record)``) and how many files the checkpoint has."""
    if path.is_dir():
        records = read_marker(path) or {}
        files = len(set(records) | set(_index_extents(path, weights_only)) | {METADATA_FILENAME})
        return [(name, record) for name, record in sorted(records.items())], files
    # A record without a CRC was written with torch's crc32 option off: nothing to compare.
    return [(r.name, r) for r in _zip_records(path) if r.crc32 != 0 or r.size == 0], 1


def _share(alone: bool) -> tuple[int, int]:
    """This rank's place among the ranks that split the files (``(0, 1)``: one process reads them all)."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() and not alone else (0, 1)


def _first_problem(path: Path, checks: list[tuple[str, Any]]) -> str | None:
    for name, record in checks:
        try:
            _compare(path, name, record) if path.is_dir() else _compare_zip_record(path, record)
        except CheckpointError as err:
            return str(err)
    return None


def _raise_on_every_rank(problem: str | None, world: int) -> None:
    problems = [problem]
    if world > 1:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    if first := next((p for p in problems if p), None):
        raise CheckpointError(first)


def _compare(folder: Path, name: str, record: FileRecord) -> None:
    crc = file_crc32(folder / name)
    if crc != record.crc32:
        raise damaged(
            folder,
            name,
            f"does not match its checksum (CRC-32 {crc:08x}, the save recorded {record.crc32:08x}): its"
            " bytes changed after saving",
        )


def _compare_zip_record(file: Path, record: _ZipRecord) -> None:
    crc = 0
    with file.open("rb") as f:
        f.seek(record.offset)
        header = f.read(30)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise damaged(file, file, f"is damaged: the zip header of record {record.name!r} is overwritten")
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        f.seek(record.offset + 30 + name_length + extra_length)
        left = record.size
        while left > 0 and (chunk := f.read(min(_CHUNK, left))):
            crc = crc32(chunk, crc)
            left -= len(chunk)
    if crc != record.crc32:
        raise damaged(
            file,
            file,
            f"does not match its checksum: record {record.name!r} has CRC-32 {crc:08x}, the save"
            f" recorded {record.crc32:08x} (its bytes changed after saving)",
        )
