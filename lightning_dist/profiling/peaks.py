"""Dense peak matmul throughput of accelerators, by device name and dtype: the denominator of MFU.

Every figure is the vendor's data-sheet number *without* 2:4 structured sparsity (data sheets print the sparse
figure, twice the dense one, with an asterisk; MFU is measured against the dense one, as PaLM and torchtitan do).
Sources: NVIDIA H100 data sheet (SXM, PCIe, NVL), H200 data sheet (SXM, NVL), HGX/DGX B200 and GB200 NVL72 specs
(per GPU: the 8- or 72-GPU figure divided by the GPU count, then halved for sparsity), A100 data sheet, L40S/L4 data
sheets, AMD Instinct MI300X/MI325X data sheets. CPU figures are not listed: on a CPU there is no MFU unless the
peak is given.
"""

from __future__ import annotations

import re

import torch

#: Dense peak TFLOP/s per device by matmul dtype (``"fp8"``, ``"bf16"``, ``"fp16"``, ``"tf32"``, ``"fp32"``). A dtype
#: a device lacks (A100 has no FP8) is absent. Keys are matched against ``torch.cuda.get_device_name()`` as whole
#: words, the longest key first (see :func:`peak_tflops`).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Blackwell
    "B200": {"fp8": 4500.0, "bf16": 2250.0, "fp16": 2250.0, "tf32": 1125.0},
    "GB200": {"fp8": 5000.0, "bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0},
    # Hopper. An SXM H100 reports no form factor ("NVIDIA H100 80GB HBM3"): plain "H100" is the SXM part.
    "H200": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H200 NVL": {"fp8": 1671.0, "bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "GH200": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H100": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H100 SXM": {"fp8": 1979.0, "bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "H100 NVL": {"fp8": 1671.0, "bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIE": {"fp8": 1513.0, "bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    # Ampere and Ada
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "L40S": {"fp8": 733.0, "bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"fp8": 242.5, "bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    # AMD CDNA 3 (ROCm builds of torch report "AMD Instinct MI300X")
    "MI300X": {"fp8": 2614.9, "bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "MI325X": {"fp8": 2614.9, "bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
}

MATMUL_DTYPES = ("fp8", "bf16", "fp16", "tf32", "fp32", "fp64")


def _words(name: str) -> str:
    return " " + re.sub(r"[\s_-]+", " ", name.upper()).strip() + " "


def device_key(device_name: str) -> str | None:
    """The :data:`PEAK_TFLOPS` key of a device named like ``torch.cuda.get_device_name()``, or ``None``.

    Keys match as whole words (``"L4"`` is not found in ``"NVIDIA L40"``, ``"H200"`` not in ``"GH200"``), ``-`` and
    ``_`` count as spaces (``"A100-SXM4-80GB"``), case is ignored, and the longest matching key wins (``"H100 PCIE"``
    before ``"H100"``).
    """
    words = _words(device_name)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if re.search(rf"(?<![A-Z0-9]){re.escape(_words(key).strip())}(?![A-Z0-9])", words):
            return key
    return None


def peak_tflops(device_name: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of the device named ``device_name`` for matmuls in ``dtype`` (one of
    :data:`MATMUL_DTYPES`), or ``None`` for a device or dtype the table does not hold."""
    if dtype not in MATMUL_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not a matmul dtype of the peak table; choose from {MATMUL_DTYPES}")
    key = device_key(device_name)
    return PEAK_TFLOPS[key].get(dtype) if key is not None else None


def matmul_dtype(precision: str) -> str:
    """The matmul dtype of a Lightning ``precision`` flag (``"bf16-mixed"`` → ``"bf16"``). ``"32-true"`` is
    ``"tf32"`` where torch runs float32 matmuls on TF32 tensor cores (``torch.backends.cuda.matmul.allow_tf32``)."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("64"):
        return "fp64"
    if torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def device_peak_tflops(device: torch.device, dtype: str) -> float | None:
    """Dense peak TFLOP/s of ``device`` for ``dtype``: ``None`` on a CPU or a device the table does not hold."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_tflops(torch.cuda.get_device_name(device), dtype)
