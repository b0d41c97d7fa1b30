"""v_scale="norm" (one least-squares scale per rotated value token, Gaussian Lloyd-Max levels) and rotate="k"/"v"
(a rotation on one stream only): the levels, the codec, the options, and a cache that reads back what it was given
(eager, compiled, fused decode) and counts what it holds."""

import pytest
import torch
from transformers import DynamicCache

from conftest import make_model
from kv_checks import compiled_matches_eager, feed, fused_decode_matches_read
from qcache import layout
from qcache import QuantCache, QuantCacheConfig
from qcache.codec import ValueCodec
from qcache.tools.footprint import reachable_bytes
from qcache.levels import _gaussian_mse, gaussian_levels, gaussian_levels_tensor
from qcache.rotation import hadamard_rotation
from test_cache import assert_greedy_agrees, generate, logits, prompt

OPTS = dict(k_group_size=16, recent_tokens=4, sink_tokens=2)
NORM = dict(rotation="hadamard", levels="lloyd-max", v_scale="norm")


# --- the levels --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,positive,mse", [
    (2, [0.4528, 1.510], 0.1175),  # Max (1960), table of the Gaussian quantizer
    (3, [0.2451, 0.7560, 1.344, 2.152], 0.03454),
    (4, [0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733], 0.009497),  # (MSE 0.009501 exactly)
])
def test_gaussian_levels_are_max_1960s(bits, positive, mse):
    levels = gaussian_levels(bits)
    assert len(levels) == 2**bits and list(levels) == sorted(levels)
    assert levels == tuple(-v for v in reversed(levels))  # symmetric
    assert [round(v, 3) for v in levels[2 ** (bits - 1):]] == pytest.approx([round(v, 3) for v in positive], abs=2e-3)
    assert _gaussian_mse(levels) == pytest.approx(mse, rel=2e-3)
    # and they beat uniform levels over the same span
    uniform = torch.linspace(levels[0], levels[-1], 2**bits)
    assert _gaussian_mse(levels) < _gaussian_mse(uniform)


# --- the codec ---------------------------------------------------------------------------------------------------

def _codec(bits, D=64):
    return ValueCodec(bits=bits, group=D, scale_dtype=torch.float16, codebook=True, rotation=True, norm=True)


@pytest.mark.parametrize("bits,bound", [(2, 0.125), (3, 0.038), (4, 0.0105)])
def test_norm_codec_error_is_the_gaussian_quantizers(bits, bound):
    """Tokens with a large mean and an outlier channel, rotated: the squared error per value, over each token's mean
    square, is at most about Lloyd-Max's for a Gaussian (0.1175 / 0.0345 / 0.0095 σ²), and the least-squares scale
    is no worse than the token's RMS would be with the same codes."""
    D = 64
    torch.manual_seed(0)
    v = torch.randn(2, 3, 200, D) + 0.5
    v[..., 5] *= 15
    consts = {"rotation": hadamard_rotation(D, seed=1), "codebook": gaussian_levels_tensor(bits)}
    codec = _codec(bits, D)
    parts = codec.encode(v, consts)
    assert set(parts) == {"v_codes", "v_scale"} and parts["v_scale"].shape == (2, 3, 200, 1)
    out = torch.cat(codec.planes(parts, consts), dim=-1)
    rel = ((out - v).pow(2).mean(-1) / v.pow(2).mean(-1)).mean()
    assert rel < bound, float(rel)
    # the same codes at the RMS scale are no better
    rot = v @ consts["rotation"]
    rms = rot.pow(2).mean(-1, keepdim=True).sqrt()
    at_rms = (torch.cat(codec.planes(parts, consts, rotated=True), dim=-1) / parts["v_scale"].float() * rms)
    assert float((out @ consts["rotation"] - rot).pow(2).mean()) <= float((at_rms - rot).pow(2).mean()) + 1e-7


def test_norm_codec_zero_token_and_bits_per_value():
    consts = {"rotation": hadamard_rotation(64, seed=0), "codebook": gaussian_levels_tensor(3)}
    codec = _codec(3)
    parts = codec.encode(torch.zeros(1, 1, 2, 64), consts)
    assert torch.equal(torch.cat(codec.planes(parts, consts), dim=-1), torch.zeros(1, 1, 2, 64))
    assert codec.bits_per_value(64) == 3 + 16 / 64
    assert [p.name for p in codec.parts(64, torch.bfloat16)] == ["v_codes", "v_scale"]
    with pytest.raises(ValueError, match="group must equal head_dim=64, got 32"):
        ValueCodec(bits=3, group=32, scale_dtype=torch.float16, codebook=True, rotation=True, norm=True).parts(
            64, torch.bfloat16)
    with pytest.raises(ValueError, match=r"norm=True\) needs codebook=True and rotation=True"):
        ValueCodec(bits=3, group=64, scale_dtype=torch.float16, codebook=True, rotation=False, norm=True)


# --- options -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(v_scale="absmax"), r"v_scale='absmax' is not supported; allowed values: \['minmax', 'norm'\]"),
    (dict(v_scale="norm", rotation="none"), r"rotation='none' rotates nothing: .*v_scale='norm' needs rotated values"),
    (dict(v_scale="norm", rotation="hadamard", levels="lloyd-max", rotate="k"), r"rotate='k'; allowed"),
    (dict(NORM, outliers=1), r"got outliers=1; allowed with it: outliers=0, or v_scale='minmax'"),
    (dict(NORM, clip_search=True), r"got clip_search=True; allowed with it: clip_search=False, or v_scale='minmax'"),
    (dict(NORM, v_group_size=32), r"got v_group_size=32; allowed with it: v_group_size=None, or v_scale='minmax'"),
    (dict(rotate="q", rotation="hadamard"), r"rotate='q' is not supported; allowed values: \['auto', 'kv', 'k', 'v'\]"),
    (dict(rotate="v", rotation="none"), r"rotate='v' needs a rotation"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantCacheConfig(**kwargs)


def test_options_round_trip_and_sizes():
    cfg = QuantCacheConfig(k_bits=3, v_bits=3, rotate="v", **NORM)
    assert QuantCacheConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.value_group_size(64) == 64
    minmax = QuantCacheConfig(k_bits=3, v_bits=3, rotation="hadamard", levels="lloyd-max", v_scale="minmax")
    # one fp16 scale per token and head instead of a scale and a zero per 64 channels
    diff = layout.bytes_per_token(minmax, 30, 3, 64, 8192) - layout.bytes_per_token(cfg, 30, 3, 64, 8192)
    assert diff == pytest.approx(30 * 3 * 2 * (8192 - layout.full_precision_tokens(cfg, 8192)) / 8192)


# --- a cache -------------------------------------------------------------------------------------------------------

def test_norm_values_bring_their_own_levels():
    """v_scale="norm" with levels="uniform": keys keep uniform levels (no codebook), values use the Gaussian ones."""
    model = make_model("llama")
    cache = QuantCache(bits=3, rotation="hadamard", v_scale="norm", **OPTS)
    generate(model, prompt(60), cache, max_new_tokens=2)
    layer = cache.layers[0]
    assert not layer.k_codec.codebook and layer.consts["k"]["codebook"] is None
    assert layer.v_codec.codebook and torch.equal(layer.consts["v"]["codebook"], gaussian_levels_tensor(3))


def test_8bit_norm_forward_near_lossless():
    """The bound tests/test_cache.py holds the 8-bit cache to: max |logit error| within 5 % of the logits' std."""
    model = make_model("llama")
    ids = prompt(90)
    ref = logits(model, ids, DynamicCache(config=model.config))
    cache = QuantCache(bits=8, **NORM, **OPTS)
    out = logits(model, ids, cache)
    assert cache.layers[0].quantized_length > 0 and cache.layers[0].v_codec.norm
    assert (out - ref).abs().max() <= 0.05 * ref.std()
    seq = generate(model, prompt(60), QuantCache(bits=8, **NORM, **OPTS), max_new_tokens=10)
    assert_greedy_agrees(model, seq, 60)


@pytest.mark.parametrize("rotate", ["kv", "k", "v"])
def test_rotate_one_stream(rotate):
    """rotate="k" / "v" rotates that stream only: the other codec has no rotation and reads without the matrix;
    the matrix is still counted once, and everything the cache holds is counted."""
    model = make_model("llama")
    # min-max values: v_scale="norm" assumes rotated values, which rotate="k" leaves plain
    cache = QuantCache(bits=4, rotation="hadamard", rotate=rotate, **OPTS, v_scale="minmax", v_group_size=16)
    generate(model, prompt(60), cache, max_new_tokens=4)
    layer = cache.layers[0]
    assert layer.k_codec.rotation == ("k" in rotate) and layer.v_codec.rotation == ("v" in rotate)
    assert ("rotation" in layer.consts["k"]) == ("k" in rotate) and ("rotation" in layer.consts["v"]) == ("v" in rotate)
    mem = cache.memory()
    assert mem.rotation == 32 * 32 * 4 and mem.total == reachable_bytes(cache)


# one compile covers the norm codec, one-stream rotation, 3-bit keys and the 8-bit residual window
COMPILED = dict(bits=3, rotate="v", window_bits=8, **NORM, **OPTS)


def test_compiled_read_and_fused_decode_with_norm_values():
    fused = compiled_matches_eager(make_model("llama").config, **COMPILED)
    assert fused.layers[0].cfg.window_bits == 8 and fused.layers[0].cfg.v_scale == "norm"
    fused_decode_matches_read(fused.layers[0], 73)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_compiled_nearest_levels_are_bucketize_codes_ties_included(bits):
    from qcache import kernels
    from qcache.quant import nearest_levels

    levels = gaussian_levels_tensor(bits).float()
    mids = (levels[1:] + levels[:-1]) / 2
    g = torch.Generator().manual_seed(bits)
    u = torch.randn(2, 3, 37, 16, generator=g) * 1.5
    u[0, 0, 0, :mids.numel()] = mids  # exactly on a midpoint: the lower level
    u[0, 0, 1, :3] = torch.tensor([-1e30, 1e30, 0.0])
    ref_codes, ref_levels = nearest_levels(u, levels)
    codes, lv = kernels.compiled("nearest_levels", ("test", bits))(u, levels)
    assert torch.equal(codes, ref_codes) and torch.equal(lv, ref_levels)
    assert torch.equal(ref_codes[0, 0, 0, :mids.numel()], torch.arange(mids.numel()))


def test_compiled_and_eager_caches_store_the_same_value_codes():
    config = make_model("llama").config
    held = []
    for kernel in ("eager", "compiled"):
        cache = QuantCache(config, kernel=kernel, **COMPILED)
        feed(cache, 0)  # a 70-token prefill: 48 tokens quantized into blocks
        assert cache.layers[0].quantized_length > 0
        held.append({n: t.clone() for n, t in cache.layers[0].store.views().items() if n.startswith("v_")})
    assert held[0].keys() == held[1].keys() and all(torch.equal(held[0][n], held[1][n]) for n in held[0])
