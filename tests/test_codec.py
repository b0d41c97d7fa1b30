"""qcache.codec: each codec round-trips within half a step, declares exactly what it stores, and states its bits per
value to the byte."""

import pytest
import torch

from qcache.codec import KeyCodec, ValueCodec
from qcache.store import PackedStore

BITS = (2, 3, 4, 8)


def states(B=2, H=3, n=64, D=32, seed=0):
    return torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(seed)) * 3


def round_trip(codec, x, consts=None):
    consts = consts or {}
    parts = codec.encode(x, consts)
    decoded = torch.cat(codec.planes(parts, consts), dim=-1)  # [B, H, n, D]
    return parts, decoded


@pytest.mark.parametrize("bits", BITS)
def test_key_codec_round_trip_within_half_a_step(bits):
    codec = KeyCodec(bits=bits, group=16, scale_dtype=torch.float32)
    x = states()
    parts, y = round_trip(codec, x)
    step = parts["k_scale"].repeat_interleave(16, dim=2)  # per channel per block -> per token
    assert ((y - x).abs() <= step / 2 + 1e-5).all()


@pytest.mark.parametrize("bits", BITS)
def test_value_codec_round_trip_within_half_a_step(bits):
    codec = ValueCodec(bits=bits, group=8, scale_dtype=torch.float32)
    x = states()
    parts, y = round_trip(codec, x)
    step = parts["v_scale"].repeat_interleave(8, dim=3)  # per token per group -> per channel
    assert ((y - x).abs() <= step / 2 + 1e-5).all()


@pytest.mark.parametrize("codec", [
    KeyCodec(bits=2, group=16, scale_dtype=torch.float16, outliers=2),
    ValueCodec(bits=3, group=16, scale_dtype=torch.float16, outliers=1),
], ids=["key", "value"])
def test_outliers_come_back_exactly(codec):
    x = states()
    x[0, 0, 5, 7] = 80.0  # a spike
    parts, y = round_trip(codec, x)
    assert y[0, 0, 5, 7] == 80.0  # the outlier's own value (a store keeps it in the cache dtype)
    plain = type(codec)(bits=codec.bits, group=codec.group, scale_dtype=codec.scale_dtype)
    _, z = round_trip(plain, x)
    assert (y - x).abs().mean() < (z - x).abs().mean()  # and the rest of its group got a tighter range


@pytest.mark.parametrize("bits", BITS)
def test_static_key_ranges_need_no_per_block_metadata(bits):
    x = states()
    lo, hi = x.amin(dim=(0, 2)), x.amax(dim=(0, 2))  # [H, D]
    consts = {"static_zero": lo, "static_scale": (hi - lo) / (2**bits - 1)}
    codec = KeyCodec(bits=bits, group=1, scale_dtype=torch.float16, static=True)
    parts, y = round_trip(codec, x, consts)
    assert set(parts) == {"k_codes"}
    assert ((y - x).abs() <= consts["static_scale"][None, :, None] / 2 + 1e-5).all()


def test_codebook_levels_are_used():
    codebook = torch.tensor([0.0, 0.1, 0.2, 1.0])
    codec = ValueCodec(bits=2, group=32, scale_dtype=torch.float32, codebook=True)
    x = states()
    parts, y = round_trip(codec, x, {"codebook": codebook})
    zero, scale = parts["v_zero"][..., :1], parts["v_scale"][..., :1]
    levels = zero + 3 * scale * codebook  # [B, H, n, 4]: every decoded value is one of its group's levels
    assert ((y[..., :, None] - levels[..., None, :]).abs().amin(-1) < 1e-4).all()
    with pytest.raises(ValueError, match="needs a codebook of 4 levels"):
        codec.planes(parts, {})


@pytest.mark.parametrize("codec", [
    KeyCodec(bits=4, group=64, scale_dtype=torch.float16),
    KeyCodec(bits=2, group=32, scale_dtype=torch.float16, outliers=1),
    KeyCodec(bits=3, group=1, scale_dtype=torch.float16, static=True),
    ValueCodec(bits=4, group=32, scale_dtype=torch.float16),
    ValueCodec(bits=2, group=16, scale_dtype=torch.bfloat16, outliers=2),
    ValueCodec(bits=8, group=64, scale_dtype=torch.float32),
], ids=lambda c: f"{type(c).__name__}-{c.bits}b-g{c.group}-m{c.outliers}")
def test_bits_per_value_is_what_the_parts_hold(codec):
    """The codec's stated bits/value == bytes of the parts it declares and fills, over the values they encode."""
    B, H, n, D = 2, 3, 128, 64
    x = states(B, H, n, D).to(torch.bfloat16)
    consts = {"static_zero": torch.zeros(H, D), "static_scale": torch.ones(H, D)} if getattr(codec, "static",
                                                                                           False) else {}
    parts = codec.encode(x.float(), consts)
    declared = codec.parts(D, torch.bfloat16)
    assert sorted(p.name for p in declared) == sorted(parts)
    store = PackedStore(declared, B, H)
    for axis in ("token", "block"):
        names = store.names(axis)
        if names:
            store.append(axis, **{name: parts[name] for name in names})
    held = sum(v for k, v in store.nbytes().items() if k != "reserved")
    assert held * 8 / (B * H * n * D) == pytest.approx(codec.bits_per_value(D, fp_bytes=2))
