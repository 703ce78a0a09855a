"""A fingerprint of a batch: equal for equal batches on any rank, so ranks can compare what they read with one
integer each.

Tensors count by dtype, shape and bytes; strings, numbers and ``None`` by value; containers by structure. Other
objects count by type name only (their ``repr`` may hold an address, different on every rank).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch


def batch_fingerprint(batch: Any) -> int:
    """A signed 63-bit digest of ``batch`` (fits an int64 tensor)."""
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, batch)
    return int.from_bytes(digest.digest(), "little") >> 1


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        digest.update(f"tensor {data.dtype} {tuple(data.shape)};".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        digest.update(f"mapping {len(value)};".encode())
        for key, item in value.items():
            _feed(digest, key)
            _feed(digest, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"sequence {len(value)};".encode())
        for item in value:
            _feed(digest, item)
    elif value is None or isinstance(value, (str, int, float, bool, bytes)):
        digest.update(f"{type(value).__name__} {value!r};".encode())
    else:
        digest.update(f"object {type(value).__qualname__};".encode())
