"""qcache's C encoder (qcache/csrc/encode.c, `native.encode_tokens`): min-max tokens coded bit for bit as the torch
encoder codes them, norm-scaled tokens with the same arithmetic (sums in another order: a scale may differ in its
last bit), used by the layers whose kernel is native or auto on CPU and by no other."""

import pytest
import torch

from qcache import QuantCache, native
from qcache.codec import ValueCodec, _NORM_ROUNDS
from qcache.levels import gaussian_levels_tensor
from qcache.rotation import SharedRotation

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler with OpenMP here")


def _tokens(D, n=600, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, n, D, generator=g) * torch.logspace(-6, 3, n)[None, None, :, None]
    x[0, 0, 0] = 0.0
    x[0, 0, 1] = -0.0
    x[0, 0, 2] = 1.5  # a constant token
    x[0, 0, 3, ::2] = 1e-9  # below fp16's smallest subnormal
    x[0, 0, 4] = -1e-9
    x[1, 2, 5, 0] = 6.5e4  # near fp16's largest value
    x[1, 2, 6, 1] = -6.5e4
    return x


@pytest.mark.parametrize("D,group,bits", [(64, 64, 8), (128, 128, 8), (256, 256, 8), (64, 32, 4), (64, 16, 2),
                                          (96, 32, 3), (80, 16, 8)])
def test_min_max_tokens_are_the_torch_encoders_bit_for_bit(D, group, bits):
    codec = ValueCodec(bits=bits, group=group, scale_dtype=torch.float16, prefix="wk_", axis="residual")
    x = _tokens(D)
    ref, got = codec.encode(x, {}), native.encode_tokens(codec, x, {})
    assert got is not None and set(got) == set(ref)
    for name in ref:
        assert got[name].dtype == ref[name].dtype and got[name].shape == ref[name].shape, name
        assert torch.equal(got[name].view(torch.uint8), ref[name].view(torch.uint8)), name


def test_a_range_beyond_fp16_is_left_to_the_torch_encoder_which_raises():
    codec = ValueCodec(bits=8, group=64, scale_dtype=torch.float16, prefix="wk_", axis="residual")
    x = torch.randn(1, 1, 4, 64)
    x[0, 0, 2, 7] = 1e5
    assert native.encode_tokens(codec, x, {}) is None
    with pytest.raises(ValueError, match="overflow scale_dtype"):
        codec.encode(x, {}, fit=native.encode_tokens)


@pytest.mark.parametrize("codec", [
    ValueCodec(bits=8, group=64, scale_dtype=torch.float32),  # fp32 scales
    ValueCodec(bits=4, group=32, scale_dtype=torch.float16, outliers=1),
    ValueCodec(bits=4, group=32, scale_dtype=torch.float16, clip_ratios=(1.0, 0.9)),
    ValueCodec(bits=2, group=64, scale_dtype=torch.float16, codebook=True),
])
def test_what_the_c_encoder_does_not_code_is_left_to_torch(codec):
    assert native.encode_tokens(codec, torch.randn(1, 1, 4, 64), {"codebook": torch.linspace(0, 1, 4)}) is None


@pytest.mark.parametrize("bits,D", [(4, 64), (3, 64), (2, 128), (8, 64), (4, 96)])
def test_norm_tokens_match_the_torch_rounds(bits, D):
    """The same codes but where the last bit of a sum moves a value across a midpoint, scales within one fp16 step,
    and the same reconstruction error."""
    rot = SharedRotation(D, 0).on(torch.device("cpu"), D)
    codec = ValueCodec(bits=bits, group=D, scale_dtype=torch.float16, codebook=True, rotation=True, norm=True)
    consts = {"rotation": rot, "codebook": gaussian_levels_tensor(bits)}
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 2000, D, generator=g)
    x[..., 5] *= 15  # an outlier channel: rotated, two clusters rather than a Gaussian
    x[0, 0, 0] = 0.0  # an all-zero token
    ref, got = codec.encode(x, consts), codec.encode(x, consts, fit=native.encode_tokens)
    assert set(got) == set(ref) and got["v_scale"].dtype == torch.float16
    assert (got["v_codes"] == ref["v_codes"]).float().mean() > 0.9999
    rel = (got["v_scale"].float() - ref["v_scale"].float()).abs() / ref["v_scale"].float().clamp_min(1e-30)
    assert (rel > 2 ** -10 * 1.01).float().mean() < 1e-3  # more than one fp16 step: a code moved
    assert (rel > 0).float().mean() < 0.01

    def error(parts):
        return (torch.cat(codec.planes(parts, consts), -1) - x).square().mean()

    assert error(got) == pytest.approx(float(error(ref)), rel=1e-3)
    assert float(got["v_scale"][0, 0, 0, 0]) == 0.0


def test_norm_fit_does_the_codecs_rounds():
    """Fed one token, the C rounds land where a plain Python rendering of the codec's rounds lands."""
    levels = gaussian_levels_tensor(3).float()
    x = torch.tensor([[0.3, -1.2, 2.5, 0.01, -0.7, 0.0, 1.1, -3.0]])
    codes, scale = native.norm_fit(x, levels, _NORM_ROUNDS)
    mids = [(float(levels[i + 1]) + float(levels[i])) / 2 for i in range(len(levels) - 1)]
    s = (sum(v * v for v in x[0].tolist()) / 8) ** 0.5
    for _ in range(_NORM_ROUNDS):
        k = [sum(v / s > m for m in mids) for v in x[0].tolist()]
        lv = [float(levels[i]) for i in k]
        s = sum(v * l for v, l in zip(x[0].tolist(), lv)) / sum(l * l for l in lv)
    assert codes[0].tolist() == k
    assert float(scale[0, 0]) == pytest.approx(s, rel=1e-6)


def _spy(monkeypatch):
    calls = []
    for name in ("encode_tokens", "encode_keys"):
        real = getattr(native, name)

        def spy(codec, x, consts, *rest, real=real):
            calls.append(codec.prefix)
            return real(codec, x, consts, *rest)

        monkeypatch.setattr(native, name, spy)
    return calls


@pytest.mark.parametrize("kernel,used", [("auto", True), ("native", True), ("eager", False), ("compiled", False)])
def test_the_layers_code_with_it_where_their_kernel_is_native(monkeypatch, kernel, used):
    from transformers import LlamaConfig

    monkeypatch.delenv("QCACHE_KERNEL", raising=False)
    calls = _spy(monkeypatch)
    config = LlamaConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96)
    cache = QuantCache(config, bits=4, rotate="kv", kernel=kernel, k_group_size=16, recent_tokens=8, sink_tokens=2)
    k, v = torch.randn(1, 2, 60, 32), torch.randn(1, 2, 60, 32)
    cache.update(k, v, 0, kwargs={"position_ids": torch.arange(60)[None]})
    assert bool(calls) == used
    if used:  # the 8-bit window (keys and values), the key blocks and the blocks' norm-scaled values
        assert set(calls) == {"wk_", "wv_", "k_", "v_"}


def test_a_cache_coded_in_c_reads_back_as_the_torch_coded_one():
    """The same tokens through kernel='native' and kernel='eager' (torch's encoder): the min-max window and key
    blocks identical, values within the last-bit differences of the norm fit."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=96)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 300, 32, generator=g), torch.randn(1, 2, 300, 32, generator=g)
    held = {}
    for kernel in ("native", "eager"):
        cache = QuantCache(config, bits=4, rotate="kv", kernel=kernel, k_group_size=16, recent_tokens=8)
        cache.update(k, v, 0, kwargs={"position_ids": torch.arange(300)[None]})
        held[kernel] = cache.layers[0].read()
    assert torch.equal(held["native"][0], held["eager"][0])
    assert torch.allclose(held["native"][1], held["eager"][1], atol=2e-3 * float(v.abs().max()))


@pytest.mark.parametrize("bits,group,D,mask", [(4, 128, 64, False), (3, 64, 128, True), (2, 32, 64, True),
                                               (8, 16, 96, False), (4, 16, 256, True)])
def test_key_blocks_are_the_torch_encoders_bit_for_bit(bits, group, D, mask):
    from qcache.codec import KeyCodec

    codec = KeyCodec(bits=bits, group=group, scale_dtype=torch.float16)
    n = 4 * group
    g = torch.Generator().manual_seed(bits)
    k = torch.randn(2, 3, n, D, generator=g) * torch.logspace(-5, 3, D)[None, None, None, :]
    k[..., 3] += 40  # an outlier channel
    k[0, 1, :group, 5] = 0.0  # a channel of zeros in one block
    k[1, 0, :, 7] = -0.0
    valid = None
    if mask:  # row 1 left-padded by a block and a half: one block of padding only, one half padding
        valid = torch.ones(2, 1, n, 1, dtype=torch.bool)
        valid[1, :, : group + group // 2] = False
    ref, got = codec.encode(k, {}, valid), codec.encode(k, {}, valid, fit=native.encode_keys)
    assert set(got) == set(ref)
    for name in ref:
        assert got[name].dtype == ref[name].dtype and got[name].shape == ref[name].shape, name
        assert torch.equal(got[name].view(torch.uint8), ref[name].view(torch.uint8)), name


def test_key_blocks_beyond_fp16_are_left_to_torch():
    from qcache.codec import KeyCodec

    codec = KeyCodec(bits=4, group=16, scale_dtype=torch.float16)
    k = torch.randn(1, 1, 32, 64)
    k[0, 0, 20, 3] = -1e6
    assert native.encode_keys(codec, k, {}) is None
    with pytest.raises(ValueError, match="overflow scale_dtype"):
        codec.encode(k, {}, fit=native.encode_keys)
