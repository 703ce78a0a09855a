"""Profiling helpers (pure PyTorch): a per-rank communication byte counter and memory accounting."""

from lightning_dist.profiling.comm import CommCounter
from lightning_dist.profiling.comm_records import BYTE_FIELDS, CommRecord, NodeTopology, canonical_op_name
from lightning_dist.profiling.memory import (
    cuda_peak_memory_bytes,
    peak_process_memory_bytes,
    reset_cuda_peak_memory_stats,
    state_bytes,
)
from lightning_dist.profiling.phase_hooks import attach_phase_hooks

__all__ = [
    "BYTE_FIELDS",
    "CommCounter",
    "CommRecord",
    "NodeTopology",
    "attach_phase_hooks",
    "canonical_op_name",
    "cuda_peak_memory_bytes",
    "peak_process_memory_bytes",
    "reset_cuda_peak_memory_stats",
    "state_bytes",
]
