"""Private torch APIs live in lightning_dist/compat/ only, so a new torch release needs one folder changed."""

from __future__ import annotations

import re
from pathlib import Path

import lightning_dist
from lightning_dist.compat import TESTED_TORCH, torch_minor_version, untested_torch_message

PACKAGE = Path(lightning_dist.__file__).parent
# `torch.x._private` or `from torch.x import _private` in code (docstrings may name them).
PRIVATE = re.compile(
    r"^\s*(from\s+torch[\w.]*\._\w+|from\s+torch[\w.]*\s+import\s+.*\b_[a-z]\w*|import\s+torch[\w.]*\._)"
)
PRIVATE_CALL = re.compile(r"\._(flatten|unflatten)\(|\b_get_current_dispatch_mode\b|\b_resolve_process_group\b")


def test_no_private_torch_import_outside_the_compat_module():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if PACKAGE / "compat" in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.match(line) or PRIVATE_CALL.search(line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "private torch APIs outside lightning_dist/compat/:\n" + "\n".join(offenders)


def test_versions_newer_than_the_tested_ones_are_named():
    assert torch_minor_version("2.14.1+cu130") == (2, 14)
    assert untested_torch_message("2.13.0+cpu") is None and untested_torch_message("2.14.1") is None
    newer = f"{max(TESTED_TORCH)[0]}.{max(TESTED_TORCH)[1] + 1}.0"
    message = untested_torch_message(newer)
    assert message is not None and f"torch {newer}" in message and "lightning_dist/compat/" in message
