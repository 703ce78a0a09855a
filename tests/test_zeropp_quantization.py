"""Blockwise quantization (one process): error bound, exactness where it must be exact, packing, awkward sizes."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_dist.parallel.quantization import (
    check_bits,
    pack,
    pack_int4,
    packed_nbytes,
    qmax,
    quantize_blockwise,
    roundtrip,
    unpack,
    unpack_int4,
)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("numel", [1, 2, 7, 97, 256, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_roundtrip_error_is_at_most_half_a_step(bits, numel, dtype):
    torch.manual_seed(numel)
    block = 16
    x = (torch.randn(3, numel) * torch.logspace(-3, 2, 3).unsqueeze(1)).to(dtype)
    buf = pack(x, bits, block)
    assert buf.dtype == torch.uint8 and buf.shape == (3, packed_nbytes(numel, bits, block))
    y = unpack(buf, numel, bits, block, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    _, scales = quantize_blockwise(x, bits, block)
    step = scales.repeat_interleave(block, dim=1)[:, :numel]  # each element's block scale
    # Half a step, plus the rounding of the result to dtype (relative eps of the value).
    eps = torch.finfo(dtype).eps
    bound = step / 2 + x.float().abs() * eps + 1e-30
    assert ((y.float() - x.float()).abs() <= bound * (1 + 1e-6)).all()


def test_exact_for_values_on_the_grid_and_zero_blocks():
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 3.0, -4.0]])
    for bits in (4, 8):
        y = roundtrip(x, bits, 4)
        assert torch.equal(y[:, :4], torch.zeros(1, 4))
        # The block's absmax is exactly on the grid (qmax steps), so it survives; all-zero blocks stay zero.
        assert y[0, 7].item() == pytest.approx(-4.0, abs=1e-6)


def test_int4_packs_two_per_byte():
    q = torch.tensor([-7, 7, 0, -8, 3, -1], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == 3
    assert torch.equal(unpack_int4(packed), q)
    # payload of int4 is half of int8's, plus one fp32 scale per block
    assert packed_nbytes(256, 4, 256) == 128 + 4
    assert packed_nbytes(256, 8, 256) == 256 + 4
    assert packed_nbytes(257, 8, 256) == 512 + 8


def test_bits_and_block_size_are_checked():
    assert qmax(8) == 127 and qmax(4) == 7
    with pytest.raises(ValueError, match="bits=3"):
        check_bits(3)
    with pytest.raises(ValueError, match="block_size"):
        pack(torch.ones(1, 4), 8, 3)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_rounding_sends_the_eager_bytes(bits, dtype):
    """``torch.compile`` of the rounding (dynamic shapes, one graph for every size) gives exactly the eager kernels'
    bytes, for sizes that are and are not multiples of the block, and values over six orders of magnitude."""
    torch.manual_seed(bits)
    for rows, numel in ((1, 1), (3, 1031), (8, 4096), (2, 70001)):
        x = (torch.randn(rows, numel) * torch.logspace(-3, 3, rows).unsqueeze(1)).to(dtype)
        compiled, eager = pack(x, bits, 256, compiled=True), pack(x, bits, 256, compiled=False)
        assert torch.equal(compiled, eager), (rows, numel)
        assert torch.equal(unpack(compiled, numel, bits, 256, dtype), unpack(eager, numel, bits, 256, dtype))


def test_a_failed_compilation_warns_once_and_computes_eagerly(monkeypatch):
    from lightning_dist.parallel import quantization

    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("no C++ compiler found")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    compiled = quantization._CompiledOn(quantization.quantize_blockwise, ("cpu",))
    x = torch.randn(2, 300)
    with pytest.warns(UserWarning, match="quantization runs eagerly: torch.compile of quantize_blockwise failed"):
        first = compiled(x, 8, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning: eager from now on
        second = compiled(x, 8, 256)
    expected = quantize_blockwise(x, 8, 256)
    assert all(torch.equal(a, b) for a, b in zip((*first, *second), (*expected, *expected)))
