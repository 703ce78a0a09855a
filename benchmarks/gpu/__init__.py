"""What needs a GPU (CUDA): :mod:`~benchmarks.gpu.throughput` (one GPU, ``python -m benchmarks.run --gpu``, also
``python -m benchmarks.gpu``; docs/throughput.md), :mod:`~benchmarks.gpu.moe` (several GPUs, fsdp2 against expert
parallelism, ``python -m benchmarks.gpu_moe``) and :mod:`~benchmarks.gpu.local_experts` (grouped expert GEMMs on
one GPU, ``python -m benchmarks.gpu_local_experts``). Each has a CPU smoke mode, which the tests run; the tests
reach each command's module through this package."""

from benchmarks.gpu import local_experts, moe, throughput

__all__ = ["local_experts", "moe", "throughput"]
