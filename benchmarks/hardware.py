"""Throughput figures for accelerator runs: tokens/s per device and model FLOPs utilization (MFU).

FLOPs per token (training, forward + backward) follow the PaLM paper (Chowdhery et al. 2022, appendix B):
``6·N + 12·L·H·S`` where ``N`` is the number of matmul parameters (embedding tables excluded), ``L`` the layers,
``H`` the width and ``S`` the sequence length (the second term is attention's ``QKᵀ`` and ``AV``, without the
causal-mask halving). MFU = achieved model FLOP/s per device / the device's dense peak for the compute dtype.
"""

from __future__ import annotations

import torch

from benchmarks.models import ModelSize

NOT_MEASURED_CPU = "not measured (CPU)"

# Dense (no sparsity) peak FLOP/s from the vendors' data sheets, by compute dtype. "fp32" is the TF32 tensor-core
# rate where PyTorch enables TF32 for matmuls and the FMA rate otherwise (see `peak_flops`).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "H100 SXM": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "H100 NVL": {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
}


def flops_per_token(size: ModelSize) -> float:
    """Training FLOPs per token: ``6·N + 12·L·H·S``."""
    return 6.0 * size.num_matmul_parameters + 12.0 * size.n_layer * size.d_model * size.seq_len


def lookup_peak(device_name: str, dtype: str) -> float | None:
    """Peak FLOP/s of a device named like ``torch.cuda.get_device_name`` (``"NVIDIA H100 80GB HBM3"``), or ``None``.

    The longest table key contained in the name wins (``"H100 PCIe"`` before ``"H100"``); an SXM H100 reports no
    form factor in its name and gets the ``"H100"`` (SXM) figures.
    """
    name = device_name.upper()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.upper() in name:
            return PEAK_FLOPS[key].get(dtype)
    return None


def compute_dtype(precision: str) -> str:
    """The matmul dtype of a Lightning precision flag, as a key of :data:`PEAK_FLOPS`."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("32") and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of ``device`` for ``precision``, or ``None`` on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    return lookup_peak(torch.cuda.get_device_name(device), compute_dtype(precision))


def throughput(
    size: ModelSize, tokens_per_step_per_device: int, step_seconds: float, peak: float | None
) -> dict[str, float | None]:
    """Tokens/s per device and MFU (``None`` without a known peak)."""
    tps = tokens_per_step_per_device / step_seconds
    mfu = tps * flops_per_token(size) / peak if peak else None
    return {"tokens_per_s_per_device": tps, "mfu": mfu}
