"""What checksums cost: a sharded save with and without CRC-32 records, and a load with and without verification,
timed side by side in one process (repeats interleaved, medians compared).

    python -m benchmarks.checkpoint_integrity              # a 192 MiB checkpoint, 5 repeats
    python -m benchmarks.checkpoint_integrity --mib 32 --repeats 3
    python -m benchmarks.checkpoint_integrity --mib 1024 --cold   # 1 GiB, every load from the disk (root)

Both saves go through ``DistributedCheckpointIO`` (DCP, its completion marker and atomic publish); the baseline's
writer just records nothing. Both loads read every tensor with DCP; ours also compares every file with its
checksum, in a thread beside the read, as a resume does (``checksums_verified_while_read``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from lightning_dist import DistributedCheckpointIO
from lightning_dist.checkpoint.integrity import checksums_verified_while_read


class _NoChecksumIO(DistributedCheckpointIO):
    """The same save, with DCP's plain file system writer: no checksum records."""

    def _storage_writer(self, folder: Path) -> FileSystemWriter:
        return FileSystemWriter(folder)


def _state(mib: int) -> dict:
    per_tensor = 4 * 1024 * 1024 // 4  # 4 MiB of fp32
    return {"state_dict": {f"w{i}": torch.randn(per_tensor) for i in range(mib // 4)}, "global_step": 1}


def _median_seconds(runs: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():  # interleaved: A B A B ...
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _drop_page_cache() -> None:
    """Make the next read come from the disk: Linux's page cache dropped (root only)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as error:
        raise SystemExit(f"--cold drops the page cache, which needs root on Linux: {error}") from None


def measure(mib: int = 192, repeats: int = 5, cold: bool = False) -> dict[str, float]:
    """Median seconds of each operation and the two ratios (with checksums / without); ``cold``: every load reads
    from the disk (the page cache dropped before it)."""
    state = _state(mib)
    root = Path(tempfile.mkdtemp(prefix="ld_integrity_"))
    try:
        paths = {"checksums": root / "with.ckpt", "plain": root / "plain.ckpt"}
        ios = {"checksums": DistributedCheckpointIO(), "plain": _NoChecksumIO()}
        save = _median_seconds({k: (lambda k=k: ios[k].save_checkpoint(state, paths[k])) for k in ios}, repeats)
        target = {"state_dict": {k: torch.empty_like(v) for k, v in state["state_dict"].items()}}

        def load(verify: bool) -> None:
            if cold:
                _drop_page_cache()
            if not verify:
                dcp.load(target, checkpoint_id=paths["checksums"], no_dist=True)
                return
            with checksums_verified_while_read(paths["checksums"]):  # as a resume verifies: beside the read
                dcp.load(target, checkpoint_id=paths["checksums"], no_dist=True)

        load_times = _median_seconds({"verified": lambda: load(True), "plain": lambda: load(False)}, repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "mib": mib,
        "cold": cold,
        "save_with_checksums_s": save["checksums"],
        "save_plain_s": save["plain"],
        "save_ratio": save["checksums"] / save["plain"],
        "load_verified_s": load_times["verified"],
        "load_plain_s": load_times["plain"],
        "load_ratio": load_times["verified"] / load_times["plain"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every load (root, Linux)")
    args = parser.parse_args()
    r = measure(args.mib, args.repeats, args.cold)
    where = "from the disk" if r["cold"] else "from the page cache"
    print(f"| {r['mib']} MiB checkpoint, loads {where} | with checksums | without | ratio |\n|---|---|---|---|")
    print(f"| save | {r['save_with_checksums_s']:.3f} s | {r['save_plain_s']:.3f} s | {r['save_ratio']:.2f} |")
    print(f"| load | {r['load_verified_s']:.3f} s | {r['load_plain_s']:.3f} s | {r['load_ratio']:.2f} |")


if __name__ == "__main__":
    main()
