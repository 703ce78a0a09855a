"""Blockwise symmetric integer quantization for communication (ZeRO++ qwZ/qgZ), in plain PyTorch.

A tensor is cut into blocks of ``block_size`` consecutive elements (the last one zero-padded); each block gets one fp32
scale ``absmax / qmax`` and its elements become integers ``round(x / scale)`` in ``[-qmax, qmax]`` (``qmax`` = 127
for int8, 7 for int4). Dequantizing gives ``q * scale``: the error of an element is at most ``scale / 2``, i.e. half a
step of its block. int4 values are packed two per byte (offset by 8 so each nibble is unsigned).

For the wire, :func:`pack` turns ``P`` rows of ``numel`` elements into ``P`` rows of :func:`packed_nbytes` bytes:
the integer payload followed by the fp32 scales, so one ``uint8`` collective moves both.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_dist.parallel.validation import is_positive_int

SUPPORTED_BITS: tuple[int, ...] = (4, 8)


def qmax(bits: int) -> int:
    """Largest quantized magnitude: 127 for int8, 7 for int4 (symmetric: ``-qmax..qmax``)."""
    check_bits(bits)
    return 2 ** (bits - 1) - 1


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; choose one of {list(SUPPORTED_BITS)}.")


def check_block_size(block_size: int) -> None:
    if not is_positive_int(block_size, 2) or block_size % 2:
        raise ValueError(f"block_size={block_size!r} must be an even integer of at least 2.")


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def packed_nbytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes one row of ``numel`` elements occupies after :func:`pack`: integer payload + 4 bytes per block."""
    blocks = num_blocks(numel, block_size)
    return blocks * block_size * bits // 8 + 4 * blocks


def quantize_blockwise(x: Tensor, bits: int, block_size: int) -> tuple[Tensor, Tensor]:
    """Quantize each row of a 2-D tensor ``[P, numel]`` blockwise.

    Returns:
        ``q``: int8 ``[P, blocks, block_size]`` with values in ``[-qmax, qmax]`` (padding is 0), and
        ``scales``: fp32 ``[P, blocks]``.
    """
    check_block_size(block_size)
    rows, numel = x.shape
    blocks = num_blocks(numel, block_size)
    padded = torch.zeros(rows, blocks * block_size, dtype=torch.float32, device=x.device)
    padded[:, :numel] = x
    padded = padded.view(rows, blocks, block_size)
    scales = padded.abs().amax(dim=-1) / qmax(bits)
    # An all-zero block has scale 0: divide by 1 instead, its integers are 0 either way.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / safe.unsqueeze(-1)).clamp_(-qmax(bits), qmax(bits)).to(torch.int8)
    return q, scales


def dequantize_blockwise(q: Tensor, scales: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`quantize_blockwise`: ``[P, numel]`` in ``dtype`` (computed in fp32, then cast once)."""
    rows = q.shape[0]
    values = q.to(torch.float32) * scales.unsqueeze(-1)
    return values.view(rows, -1)[:, :numel].to(dtype)


def pack_int4(q: Tensor) -> Tensor:
    """Pack int4 values (int8 in ``[-8, 7]``, even count along the last dim) two per byte: ``[..., n/2]`` uint8."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_int4`: int8 ``[..., 2 * n]``."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)


class _CompiledOn:
    """``fn`` compiled by ``torch.compile`` (dynamic shapes: one graph for every unit's size) when its first tensor is
    on one of ``devices``, else run eagerly. Compiled on first use; a failure to compile (no C++ compiler for the
    CPU backend, an unsupported device) warns once and runs ``fn`` eagerly from then on. ``TORCHDYNAMO_DISABLE=1``
    turns every compilation off, this one included."""

    def __init__(self, fn: Callable[..., Any], devices: tuple[str, ...]) -> None:
        self.fn = fn
        self.devices = devices
        self._compiled: Callable[..., Any] | None = None
        self._failed = False

    def __call__(self, x: Tensor, *args: Any) -> Any:
        if self._failed or x.device.type not in self.devices:
            return self.fn(x, *args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self._compiled(x, *args)
        except Exception as err:  # noqa: BLE001 (a compiler failure: the eager function computes the same)
            self._failed = True
            warnings.warn(
                f"ZeRO++ quantization runs eagerly: torch.compile of {self.fn.__name__} failed on {x.device.type}"
                f" ({type(err).__name__}: {str(err)[:200]}).",
                stacklevel=2,
            )
            return self.fn(x, *args)


# Measured on CPU (benchmarks/studies/zeropp_quantization.py): the compiled rounding is 3 to 5 times as fast as the
# eager kernels, with the same bytes; the compiled dequantization was slower there, so it is compiled on CUDA only.
# Whether to compile at all is the caller's (`compiled=`): ZeRO++ compiles on CUDA, and on the CPU with `compile`.
_quantize = _CompiledOn(quantize_blockwise, ("cpu", "cuda"))
_dequantize = _CompiledOn(dequantize_blockwise, ("cuda",))


def pack(x: Tensor, bits: int, block_size: int, compiled: bool = False) -> Tensor:
    """Quantize the rows of ``x`` (``[P, numel]``, any floating dtype) into wire bytes ``[P, packed_nbytes]``.
    ``compiled``: the rounding through ``torch.compile`` (the same bytes as the eager kernels)."""
    q, scales = (_quantize if compiled else quantize_blockwise)(x, bits, block_size)
    rows = q.shape[0]
    payload = q.view(rows, -1)
    payload = pack_int4(payload) if bits == 4 else payload.view(torch.uint8)
    return torch.cat((payload, scales.view(torch.uint8).view(rows, -1)), dim=1)


def unpack(
    buffer: Tensor, numel: int, bits: int, block_size: int, dtype: torch.dtype, compiled: bool = False
) -> Tensor:
    """Dequantize wire bytes ``[P, packed_nbytes]`` written by :func:`pack` into ``[P, numel]`` of ``dtype``
    (``compiled``: through ``torch.compile`` on CUDA)."""
    rows = buffer.shape[0]
    blocks = num_blocks(numel, block_size)
    payload_bytes = blocks * block_size * bits // 8
    payload, scale_bytes = buffer[:, :payload_bytes], buffer[:, payload_bytes:]
    q = unpack_int4(payload) if bits == 4 else payload.contiguous().view(torch.int8)
    scales = scale_bytes.clone().view(torch.float32).view(rows, blocks)  # a copy: aligned for the fp32 view
    return (_dequantize if compiled else dequantize_blockwise)(q.view(rows, blocks, block_size), scales, numel, dtype)


def roundtrip(x: Tensor, bits: int, block_size: int) -> Tensor:
    """``unpack(pack(x))`` for a tensor of any shape: what a quantized collective delivers for ``x``."""
    flat = x.reshape(1, -1)
    return unpack(pack(flat, bits, block_size), flat.shape[1], bits, block_size, x.dtype).view(x.shape)
