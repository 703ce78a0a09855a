"""Blockwise quantization (one process): error bound, exactness where it must be exact, packing, awkward sizes."""

from __future__ import annotations

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
