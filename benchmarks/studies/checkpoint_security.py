"""What safe loading costs: reading a sharded checkpoint's metadata with full pickle (torch's reader, the package
before it was restricted) and with the restricted readers, timed side by side in one process (interleaved repeats,
medians compared).

    python -m benchmarks.checkpoint_security                 # an index of 3,000 entries, 20 repeats
    python -m benchmarks.checkpoint_security --keys 300 --repeats 5

Three reads: the DCP ``.metadata`` index (torch's ``FileSystemReader`` against ours), ``meta.pt`` (``torch.load``
with ``weights_only=False`` against ``True``) and the "is this ours?" probe a save runs on its destination
(``torch.load(weights_only=False, mmap=True)`` against reading the plain entries only).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader

from benchmarks.studies.checkpoint_integrity import _median_seconds
from lightning_dist import DistributedCheckpointIO
from lightning_dist.checkpoint.layout import METADATA_FILENAME
from lightning_dist.checkpoint.safe_load import RestrictedFileSystemReader, probe_entries


def _state(keys: int) -> dict:
    """``keys`` small tensors (the index grows with the number of entries, not their size) and Lightning-like
    metadata entries."""
    loops = {f"loop_{i}": {"state_dict": {}, "progress": {"total": {"ready": i, "completed": i}}} for i in range(8)}
    return {
        "state_dict": {f"layers.{i // 8}.w{i % 8}": torch.zeros(4, 4) for i in range(keys)},
        "global_step": 1,
        "loops": loops,
        "hyper_parameters": {"lr": 1e-3, "layers": keys // 8, "name": "bench"},
    }


def measure(keys: int = 3000, repeats: int = 20) -> dict[str, float]:
    """Median seconds of each read, full pickle against restricted, and their ratios (restricted / full)."""
    root = Path(tempfile.mkdtemp(prefix="ld_security_"))
    try:
        path = root / "sharded.ckpt"
        DistributedCheckpointIO().save_checkpoint(_state(keys), path)
        meta = path / METADATA_FILENAME
        runs = {
            "index_full": lambda: FileSystemReader(path).read_metadata(),
            "index_restricted": lambda: RestrictedFileSystemReader(path).read_metadata(),
            "meta_full": lambda: torch.load(meta, weights_only=False, mmap=True),
            "meta_restricted": lambda: torch.load(meta, weights_only=True, mmap=True),
            "probe_full": lambda: torch.load(meta, weights_only=False, mmap=True),
            "probe_restricted": lambda: probe_entries(meta),
        }
        times = _median_seconds(runs, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result: dict[str, float] = {"keys": keys, **{f"{name}_s": t for name, t in times.items()}}
    for read in ("index", "meta", "probe"):
        result[f"{read}_ratio"] = times[f"{read}_restricted"] / times[f"{read}_full"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    r = measure(args.keys, args.repeats)
    print(f"| read ({r['keys']:,} index entries) | full pickle | restricted | ratio |\n|---|---|---|---|")
    for read, label in (("index", "DCP `.metadata`"), ("meta", "`meta.pt`"), ("probe", "save-destination probe")):
        full, restricted = r[f"{read}_full_s"] * 1e3, r[f"{read}_restricted_s"] * 1e3
        print(f"| {label} | {full:.2f} ms | {restricted:.2f} ms | {r[f'{read}_ratio']:.2f} |")


if __name__ == "__main__":
    main()
