"""Throughput figures for accelerator runs: tokens/s per device and model FLOPs utilization (MFU).

FLOPs per token (training, forward + backward) follow the PaLM paper (Chowdhery et al. 2022, appendix B):
``6·N + 12·L·H·S`` where ``N`` is the number of matmul parameters (embedding tables excluded), ``L`` the layers,
``H`` the width and ``S`` the sequence length (the second term is attention's ``QKᵀ`` and ``AV``, without the
causal-mask halving). MFU = achieved model FLOP/s per device / the device's dense peak for the compute dtype. The
formula and the peak table are the package's (:mod:`lightning_dist.profiling.flops`, :mod:`.peaks`), which the
``MeshThroughputMonitor`` callback logs with.
"""

from __future__ import annotations

import torch

from benchmarks.common.models import ModelSize
from lightning_dist import profiling

NOT_MEASURED_CPU = "not measured (CPU)"


def flops_per_token(size: ModelSize) -> float:
    """Training FLOPs per token: ``6·N + 12·L·H·S`` (:func:`lightning_dist.profiling.flops_per_token`)."""
    return profiling.flops_per_token(size.num_matmul_parameters, size.n_layer, size.d_model, size.seq_len)


def lookup_peak(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of a device named like ``torch.cuda.get_device_name`` (``"NVIDIA H100 80GB HBM3"``), or
    ``None``: the package's table, :data:`lightning_dist.profiling.PEAK_TFLOPS`, in FLOP/s."""
    peak = profiling.peak_tflops(device_name, dtype)
    return peak * 1e12 if peak is not None else None


def compute_dtype(precision: str) -> str:
    """The matmul dtype of a Lightning precision flag (:func:`lightning_dist.profiling.matmul_dtype`)."""
    return profiling.matmul_dtype(precision)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of ``device`` for ``precision``, or ``None`` on CPU or an unknown GPU."""
    peak = profiling.device_peak_tflops(device, compute_dtype(precision))
    return peak * 1e12 if peak is not None else None


def throughput(
    size: ModelSize, tokens_per_step_per_device: int, step_seconds: float, peak: float | None
) -> dict[str, float | None]:
    """Tokens/s per device and MFU (``None`` without a known peak)."""
    tps = tokens_per_step_per_device / step_seconds
    mfu = tps * flops_per_token(size) / peak if peak else None
    return {"tokens_per_s_per_device": tps, "mfu": mfu}
