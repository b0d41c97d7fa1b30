"""qcache.quant: packing is exact, quantization is within half a step."""

import pytest
import torch

from qcache.quant import (
    SUPPORTED_BITS,
    WIDTHS,
    choose_qparams,
    dequantize,
    dequantize_grouped,
    pack,
    quantize_grouped,
    unpack,
)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("shape", [(8,), (3, 16), (2, 3, 5, 64)])
def test_pack_unpack_round_trip_exact(bits, shape):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, shape, generator=gen, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == shape[-1] * bits // 8  # really packed: bits/8 bytes per value
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_extremes(bits):
    codes = torch.tensor([0, 2**bits - 1] * 8, dtype=torch.uint8)
    assert torch.equal(unpack(pack(codes, bits), bits), codes)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_width_row_states_its_packing(bits):
    """A width's row is the whole truth about it: the bytes pack() writes, and planes that unpack() concatenates."""
    row = WIDTHS[bits]
    n = 8 * row.codes_per_unit
    codes = torch.randint(0, 2**bits, (3, n), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = row.pack(codes)
    assert packed.shape[-1] == row.packed_bytes(n) == n * bits // 8
    planes = row.planes(packed)
    assert len(planes) % 2 == 0 and len({p.shape for p in planes}) == 1  # equal slices, RoPE pairs line up
    assert torch.equal(torch.cat(planes, dim=-1), codes)


def test_supported_bits_are_the_rows():
    assert SUPPORTED_BITS == tuple(WIDTHS) == (2, 3, 4, 8)


@pytest.mark.parametrize("bits", [1, 5, 16])
def test_unsupported_bits_raise(bits):
    with pytest.raises(ValueError, match=rf"bits={bits}.*\[2, 3, 4, 8\]"):
        pack(torch.zeros(8, dtype=torch.uint8), bits)


def test_pack_needs_whole_units():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(torch.zeros(12, dtype=torch.uint8), 3)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("dim", [-1, -2])
@pytest.mark.parametrize("group_size", [8, 32])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_error_within_half_step(bits, dim, group_size, scale_dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, 64, generator=gen) * 3 + 5  # an offset makes zero-point rounding matter
    x[..., 7] += 40.0  # an outlier channel
    codes, scale, zero = quantize_grouped(x, bits, group_size, dim, scale_dtype=scale_dtype)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 2**bits - 1
    assert scale.dtype == zero.dtype == scale_dtype
    xr = dequantize_grouped(codes, scale, zero, group_size, dim)
    step = scale.float().repeat_interleave(group_size, dim=dim)
    err = (xr - x).abs()
    assert bool((err <= step / 2 + 1e-4 * x.abs() + 1e-6).all()), float((err - step / 2).max())


def test_mask_keeps_padding_out_of_statistics():
    x = torch.randn(1, 1, 16, 8)
    mask = torch.ones(1, 1, 16, 1, dtype=torch.bool)
    mask[:, :, :4] = False
    x_padded = x.clone()
    x_padded[:, :, :4] = 1e4  # huge padding values
    _, s_ref, z_ref = quantize_grouped(x[:, :, 4:], 4, 12, dim=2)
    _, s, z = quantize_grouped(x_padded, 4, 16, dim=2, mask=mask)
    assert torch.equal(s, s_ref) and torch.equal(z, z_ref)


def test_constant_group_has_positive_scale():
    x = torch.full((1, 16), 3.0)
    codes, scale, zero = quantize_grouped(x, 2, 16, dim=-1)
    assert bool((scale > 0).all())
    assert torch.allclose(dequantize(codes, scale, zero), x, atol=1e-3)


def test_scale_dtype_overflow_raises():
    with pytest.raises(ValueError, match="float32"):
        choose_qparams(torch.tensor([-1e6]), torch.tensor([1e6]), 4, torch.float16)


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="group_size=24"):
        quantize_grouped(torch.randn(2, 64), 4, 24, dim=-1)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_clip_search_never_increases_group_error(bits):
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(4, 256, 64, generator=gen)
    x[:, ::37] *= 6  # heavy tails make clipping worth it
    plain = dequantize_grouped(*quantize_grouped(x, bits, 32, dim=-1), 32, dim=-1)
    clipped = dequantize_grouped(*quantize_grouped(x, bits, 32, dim=-1, clip_ratios=(1.0, 0.9, 0.8, 0.7)), 32, dim=-1)
    err_plain = (plain - x).pow(2).view(4, 256, 2, 32).sum(-1)
    err_clip = (clipped - x).pow(2).view(4, 256, 2, 32).sum(-1)
    assert bool((err_clip <= err_plain + 1e-6).all())  # each group keeps its best candidate (1.0 included)
    assert float(err_clip.sum()) < float(err_plain.sum())


def test_codebook_levels_round_trip():
    codebook = torch.tensor([0.0, 0.3, 0.55, 1.0])
    x = torch.rand(8, 32)
    codes, scale, zero = quantize_grouped(x, 2, 32, dim=-1, codebook=codebook)
    xr = dequantize_grouped(codes, scale, zero, 32, dim=-1, codebook=codebook)
    rng = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True))
    # nearest level: error at most half the widest gap between levels
    assert bool(((xr - x).abs() <= rng * 0.45 / 2 + 1e-3).all())
    assert torch.equal(codes.unique().sort().values, torch.arange(4, dtype=torch.uint8))
