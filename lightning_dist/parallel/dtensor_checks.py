"""Whole-tensor truth tests (``_is_any_true``/``_is_all_true``) on DTensors.

Autograd's anomaly detection (``Trainer(detect_anomaly=True)``, ``torch.autograd.detect_anomaly()``) tests every
gradient a backward function returns with ``isnan(grad)._is_any_true()``, and ``torch._check``/distributions'
argument validation use ``_is_all_true``. torch registers no DTensor sharding rule for either, so under tensor
parallelism the first checked backward raised ``NotImplementedError: Operator aten._is_any_true.default does not have
a sharding strategy registered``. The rule registered here computes them on the replicated tensor: every rank sees
the answer for the whole tensor (a NaN in any shard stops every rank, not only its holder), at the cost of
gathering a boolean tensor, paid only where the check runs (a debugging mode).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.experimental import register_sharding

from lightning_dist.compat import truth_test_ops

_registered = False


def _on_whole_tensor(tensor: Any) -> list[tuple[list[Any], list[Any]]]:
    return [([Replicate()], [Replicate()])]


def register_truth_test_sharding() -> None:
    """Register the rule for both truth tests (once per process; later calls do nothing)."""
    global _registered
    if not _registered:
        register_sharding(truth_test_ops())(_on_whole_tensor)
        _registered = True
