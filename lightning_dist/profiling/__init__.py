"""Profiling helpers (pure PyTorch): a per-rank communication byte counter and memory accounting."""

from lightning_dist.profiling.comm import (
    BYTE_FIELDS,
    CommCounter,
    CommRecord,
    NodeTopology,
    attach_phase_hooks,
    canonical_op_name,
)
from lightning_dist.profiling.memory import (
    cuda_peak_memory_bytes,
    peak_process_memory_bytes,
    reset_cuda_peak_memory_stats,
    state_bytes,
)

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
