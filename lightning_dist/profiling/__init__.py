"""Profiling helpers (pure PyTorch): a per-rank communication byte counter, memory accounting, and throughput
(FLOPs per token, device peaks, tokens/s and MFU)."""

from lightning_dist.parallel.expert_parallel.structure import find_experts
from lightning_dist.profiling.comm import CommCounter
from lightning_dist.profiling.comm_records import BYTE_FIELDS, CommRecord, NodeTopology, canonical_op_name
from lightning_dist.profiling.flops import TokenFlops, flops_per_token, token_flops
from lightning_dist.profiling.memory import (
    cuda_peak_memory_bytes,
    peak_process_memory_bytes,
    reset_cuda_peak_memory_stats,
    state_bytes,
)
from lightning_dist.profiling.peaks import PEAK_TFLOPS, device_peak_tflops, matmul_dtype, peak_tflops
from lightning_dist.profiling.phase_hooks import attach_phase_hooks
from lightning_dist.profiling.throughput import throughput_figures, token_ids

__all__ = [
    "BYTE_FIELDS",
    "PEAK_TFLOPS",
    "CommCounter",
    "CommRecord",
    "NodeTopology",
    "TokenFlops",
    "attach_phase_hooks",
    "canonical_op_name",
    "cuda_peak_memory_bytes",
    "device_peak_tflops",
    "find_experts",
    "flops_per_token",
    "matmul_dtype",
    "peak_process_memory_bytes",
    "peak_tflops",
    "reset_cuda_peak_memory_stats",
    "state_bytes",
    "throughput_figures",
    "token_flops",
    "token_ids",
]
