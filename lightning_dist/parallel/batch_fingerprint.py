"""A fingerprint of a batch, for ranks to compare what they read without sending the batch.

Everything but floating-point values (integer and boolean tensors such as token ids and labels, every tensor's dtype
and shape, strings, numbers, the containers' structure) goes into one exact digest. Floating-point tensors are
summarized by three float64 numbers each (the sum, the sum of magnitudes and a position-weighted sum, which tells a
flipped image from the original), compared with a relative tolerance: preprocessing that runs on different CPUs
(pipeline stages on other nodes) may round differently, and that is not another batch. Objects of other types count
by type name only (their ``repr`` may hold an address, different on every rank).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: Largest difference between the float summaries of one batch read on two ranks, relative to its sum of magnitudes.
FLOAT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class BatchFingerprint:
    exact: int  # a 63-bit digest of everything but floating-point values
    floats: tuple[float, ...]  # per floating-point tensor: sum, sum of magnitudes, position-weighted sum

    def same_batch(self, other: BatchFingerprint) -> bool:
        """Whether ``other`` is a fingerprint of the same batch (floats within :data:`FLOAT_TOLERANCE`)."""
        if self.exact != other.exact or len(self.floats) != len(other.floats):
            return False
        for start in range(0, len(self.floats), 3):
            scale = max(abs(self.floats[start + 1]), abs(other.floats[start + 1]), 1e-30)
            pairs = zip(self.floats[start : start + 3], other.floats[start : start + 3])
            if any(abs(mine - theirs) > FLOAT_TOLERANCE * scale for mine, theirs in pairs):
                return False
        return True


def batch_fingerprint(batch: Any) -> BatchFingerprint:
    digest = hashlib.blake2b(digest_size=8)
    floats: list[float] = []
    _feed(digest, floats, batch)
    return BatchFingerprint(int.from_bytes(digest.digest(), "little") >> 1, tuple(floats))


def _feed(digest: Any, floats: list[float], value: Any) -> None:
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        digest.update(f"tensor {data.dtype} {tuple(data.shape)};".encode())
        if data.is_floating_point() or data.is_complex():
            flat = torch.view_as_real(data).reshape(-1) if data.is_complex() else data.reshape(-1)
            flat = flat.double()
            weights = (torch.arange(flat.numel(), dtype=torch.float64) % 251 + 1) / 251
            floats += [float(flat.sum()), float(flat.abs().sum()), float((flat * weights).sum())]
        else:
            digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        digest.update(f"mapping {len(value)};".encode())
        for key, item in value.items():
            _feed(digest, floats, key)
            _feed(digest, floats, item)
    elif isinstance(value, (list, tuple)):
        digest.update(f"sequence {len(value)};".encode())
        for item in value:
            _feed(digest, floats, item)
    elif value is None or isinstance(value, (str, int, float, bool, bytes)):
        digest.update(f"{type(value).__name__} {value!r};".encode())
    else:
        digest.update(f"object {type(value).__qualname__};".encode())
