"""rotation="hadamard" (qcache/rotation.py): the matrix, and a cache that rotates tokens before quantizing them
reads back what it was given (eager, compiled, fused decode), counts the matrix once, and keeps crop / beam search
working."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from conftest import COMMON, make_model
from kv_checks import compiled_matches_eager, fused_decode_matches_read
from qcache.presets import recipe
from qcache import QuantCache, QuantCacheConfig
from qcache.calibfile import CalibrationData, legacy_recipe, load_calibration, save_calibration
from qcache.cache import model_fingerprint
from qcache.tools.footprint import reachable_bytes
from qcache.rotation import SharedRotation, check_rotation_dim, hadamard_rotation, rotation_block
from test_cache import assert_greedy_agrees, generate, logits, prompt

# the residual window as given, so that the tokens outside the quantized region read back exactly
OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2, window_bits=16)
ROT = dict(rotation="hadamard", rotate="kv")


# --- the matrix --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("D", [8, 32, 128, 256])
def test_rotation_is_orthogonal_and_seeded(D):
    R = hadamard_rotation(D, seed=3)
    torch.testing.assert_close(R @ R.T, torch.eye(D), atol=1e-5, rtol=0)
    assert R.dtype == torch.float32 and bool((R.abs() == D**-0.5).all())
    assert torch.equal(R, hadamard_rotation(D, seed=3))
    assert not torch.equal(R, hadamard_rotation(D, seed=4))


@pytest.mark.parametrize("D", [64, 80, 96, 120, 256])
def test_rotation_is_orthogonal_for_multiples_of_8(D):
    R = hadamard_rotation(D, seed=5)
    assert R.shape == (D, D) and R.dtype == torch.float32
    torch.testing.assert_close(R @ R.T, torch.eye(D), atol=1e-5, rtol=0)
    torch.testing.assert_close(R.T @ R, torch.eye(D), atol=1e-5, rtol=0)
    assert torch.equal(R, hadamard_rotation(D, seed=5)) and not torch.equal(R, hadamard_rotation(D, seed=6))


def _sylvester(n):
    """H_n built here, independently of qcache: H_2n = [[H, H], [H, -H]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("D", [8, 16, 64, 128, 256])
@pytest.mark.parametrize("seed", [0, 3])
def test_power_of_two_is_the_full_sylvester_rotation(D, seed):
    """For a power-of-two head_dim there is one block: R is bit for bit H_D · diag(s) / sqrt(D), with the same sign
    draw as before block-diagonal rotations existed (matrices for existing caches do not change)."""
    assert rotation_block(D) == D
    signs = torch.randint(0, 2, (D,), generator=torch.Generator().manual_seed(seed)).to(torch.float64) * 2 - 1
    ref = (_sylvester(D) * signs[None, :] / D**0.5).to(torch.float32)
    assert torch.equal(hadamard_rotation(D, seed=seed), ref)


@pytest.mark.parametrize("D,b", [(96, 32), (120, 8), (80, 16), (48, 16), (24, 8)])
def test_other_multiples_of_8_are_block_diagonal(D, b):
    assert rotation_block(D) == b
    R = hadamard_rotation(D, seed=1)
    signs = torch.randint(0, 2, (D,), generator=torch.Generator().manual_seed(1)).to(torch.float64) * 2 - 1
    blocks = torch.block_diag(*[_sylvester(b)] * (D // b))
    assert torch.equal(R, (blocks * signs[None, :] / b**0.5).to(torch.float32))
    on_block = torch.block_diag(*[torch.ones(b, b, dtype=torch.bool)] * (D // b))
    assert bool((R[~on_block] == 0).all()) and bool((R[on_block].abs() == b**-0.5).all())
    x = torch.zeros(D)
    x[b + 1] = 1.0  # an outlier channel in the second block spreads over that block only
    assert (x @ R).nonzero().flatten().tolist() == list(range(b, 2 * b))


@pytest.mark.parametrize("D", [4, 12, 66, 100])
def test_head_dim_not_a_multiple_of_8_raises(D):
    match = rf"head_dim={D} \(allowed: multiples of 8"
    for build in (hadamard_rotation, check_rotation_dim, rotation_block, SharedRotation):
        with pytest.raises(ValueError, match=match):
            build(D)
    config = LlamaConfig(num_hidden_layers=1, **{**COMMON, "head_dim": D})
    for rotate in ("kv", "k", "v"):
        with pytest.raises(ValueError, match=rf"head_dim={D}"):
            QuantCache(config, rotation="hadamard", rotate=rotate, v_scale="minmax")
    with pytest.raises(ValueError, match=rf"window_keys='rotated' .*head_dim={D} .*allowed here: window_keys='minmax'"):
        QuantCache(config, rotation="none", rotate="kv", v_scale="minmax")
    QuantCache(config, rotation="none", rotate="kv", v_scale="minmax", window_keys="minmax")  # without rotation: fine


@pytest.mark.parametrize("D", [0, -8])
def test_head_dim_not_positive_raises(D):
    with pytest.raises(ValueError, match=rf"head_dim={D} \(allowed: multiples of 8"):
        rotation_block(D)


def test_head_dim_80_model_with_4bit_rotated_cache():
    """A tiny Llama with head_dim 80 (5 blocks of 16): a 4-bit rotated cache builds, holds one [80, 80] matrix, reads
    back what it was given (8-bit near-lossless; 4-bit no worse than twice the unrotated 4-bit cache), and generates."""
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, **{**COMMON, "hidden_size": 160, "head_dim": 80})
    model = LlamaForCausalLM(config).eval()
    ids = prompt(70)
    ref = logits(model, ids, DynamicCache(config=model.config))
    rot = dict(rotation="hadamard", rotate="kv")  # explicit: keys and values rotated, whatever the defaults
    cache = QuantCache(bits=4, **rot, **OPTS)
    out = logits(model, ids, cache)
    layer = cache.layers[0]
    assert layer.quantized_length > 0 and layer.k_codec.rotation and layer.v_codec.rotation
    assert cache.memory().rotation == 80 * 80 * 4
    assert torch.isfinite(out).all()
    plain = logits(model, ids, QuantCache(bits=4, rotation="none", rotate="kv", **OPTS))
    # 4 bits: not lossless, but the rotated cache errs no more than twice the unrotated one
    assert (out - ref).abs().max() <= max(2 * (plain - ref).abs().max(), 0.05 * ref.std())
    # 8 bits: near-lossless, the bound test_8bit_forward_with_rotation_near_lossless holds (measured 0.015 vs 0.034)
    assert (logits(model, ids, QuantCache(bits=8, **rot, **OPTS)) - ref).abs().max() <= 0.05 * ref.std()
    seq = generate(model, prompt(40), QuantCache(bits=4, **rot, **OPTS), max_new_tokens=5)
    assert seq.shape == (1, 45)


# --- options -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(rotation="random"), r"rotation='random' is not supported; allowed values: \['none', 'hadamard'\]"),
    (dict(rotation_seed=-1), r"rotation_seed=-1 must be a non-negative integer"),
    (dict(rotation="hadamard", static_keys=True), r"rotation='hadamard' is not supported with static_keys=True"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantCacheConfig(**kwargs)


def test_options_round_trip_and_old_dicts_load():
    cfg = QuantCacheConfig(k_bits=3, v_bits=3, rotation="hadamard", rotation_seed=7, levels="lloyd-max",
                           codebooks=False)
    assert QuantCacheConfig.from_dict(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("rotation", "rotation_seed", "levels", "v_scale",
                                                              "rotate", "window_bits")}
    # files written before these options: the behaviour from before them (no rotation, min-max values, 16-bit window)
    legacy = legacy_recipe(old)
    assert (legacy.rotation, legacy.rotate, legacy.v_scale, legacy.levels, legacy.window_bits) == (
        "none", "kv", "minmax", "uniform", 16)
    with pytest.raises(ValueError, match=r"missing \['rotation', 'rotation_seed', 'levels'"):
        QuantCacheConfig.from_dict(old)  # a complete recipe names every option
    with pytest.raises(ValueError, match=r"got unknown \['future'\]"):
        QuantCacheConfig.from_dict({**cfg.to_dict(), "future": 1})
    with pytest.raises(ValueError, match=r"unknown QuantCacheConfig options \['future'\]"):
        legacy_recipe({**old, "future": 1})


def test_calibrated_codebooks_go_to_unrotated_streams_only_and_file_keeps_options(tmp_path):
    config = make_model("llama").config
    options = recipe(bits=4, rotation="hadamard", rotate="kv", codebooks=False).to_dict()
    levels = {i: {"k_codebook": torch.linspace(0, 1, 16) ** 2, "v_codebook": torch.linspace(0, 1, 16) ** 3}
              for i in range(2)}
    data = CalibrationData(model_fingerprint(config), options, {}, levels)
    loaded = load_calibration(save_calibration(tmp_path / "rot.safetensors", data))
    assert loaded.options == options
    cache = QuantCache.from_calibration(tmp_path / "rot.safetensors", config)  # the file's options: no codebooks
    assert cache.options.rotation == "hadamard" and not cache.layers[0].k_codec.codebook
    # values rotated (Gaussian "norm" levels), keys unrotated: the keys take the file's levels, the values do not
    keys_only = QuantCache.from_calibration(tmp_path / "rot.safetensors", config, rotate="v", codebooks=True)
    layer = keys_only.layers[0]
    assert layer.k_codec.codebook and torch.equal(layer.consts["k"]["codebook"], levels[0]["k_codebook"])
    assert layer.consts["v"]["codebook"] is None and keys_only.options.v_scale == "norm"
    with pytest.raises(ValueError, match=r"leaves no stream the file's codebooks were fitted for"):
        QuantCache.from_calibration(tmp_path / "rot.safetensors", config, codebooks=True)  # both streams rotated


# --- what the cache reads back -------------------------------------------------------------------------------------

def test_8bit_forward_with_rotation_near_lossless():
    """Max |logit error| within 5% of the logits' std, the bound tests/test_cache.py holds the 8-bit cache to
    without rotation (fp32): R is orthogonal, so a token's quantization error keeps its norm through R^T
    (measured 0.025 with rotation, 0.017 without)."""
    model = make_model("llama")
    ids = prompt(90)
    ref = logits(model, ids, DynamicCache(config=model.config))
    cache = QuantCache(bits=8, **ROT, **OPTS)
    out = logits(model, ids, cache)
    assert cache.layers[0].quantized_length > 0
    assert (out - ref).abs().max() <= 0.05 * ref.std()
    seq = generate(model, prompt(60), QuantCache(bits=8, **ROT, **OPTS), max_new_tokens=10)
    assert_greedy_agrees(model, seq, 60)


def _outlier_states(seed=0, n=80, H=2, D=32):
    """[1, H, n, D] fp32 heavy-tailed (student-t, 3 dof) states with an outlier channel (x 20)."""
    torch.manual_seed(seed)
    x = torch.distributions.StudentT(3.0).sample((1, H, n, D))
    x[..., 3] *= 20
    return x


@pytest.mark.parametrize("rope", ["pre", "post"])
def test_2bit_rotation_reads_outlier_states_closer(rope):
    """Keys and values with an outlier channel through layer 0 at 2 bits: the quantized region reads back closer to
    what was stored with rotation than without. Measured squared error, rotated / plain: values 0.53 (a value group
    spans channels: the outlier channel sets every group's range without rotation); keys 0.89 (rope="pre") and 0.99
    ("post"): key groups are per channel, which already isolates an outlier channel; rotation only makes each
    channel's heavy tails more Gaussian (a sum over channels), and with rope="pre" the outlier is first spread over
    its RoPE pair."""
    config = make_model("llama").config
    k, v = _outlier_states(0), _outlier_states(1)
    errs = {}
    for rot in ("none", "hadamard"):
        cache = QuantCache(config, bits=2, rotation=rot, rope=rope, rotate="kv",
                           levels="uniform", **OPTS)  # uniform levels on both sides: rotation is what differs
        cache.update(k, v, 0, kwargs={"position_ids": torch.arange(80)[None]})
        layer = cache.layers[0]
        S, Tq = layer.store.length("sink"), layer.quantized_length
        rk, rv = layer.read()
        q = slice(S, S + Tq)
        errs[rot] = [float((rk[:, :, q] - k[:, :, q]).pow(2).mean()), float((rv[:, :, q] - v[:, :, q]).pow(2).mean())]
        assert torch.equal(rk[:, :, :S], k[:, :, :S]) and torch.equal(rk[:, :, S + Tq:], k[:, :, S + Tq:])
    assert errs["hadamard"][0] < (0.95 if rope == "pre" else 1.0) * errs["none"][0], errs
    assert errs["hadamard"][1] < 0.6 * errs["none"][1], errs


# one compiled configuration covers rotation with outliers and lloyd-max levels (each compile costs seconds)
COMPILED = dict(bits=2, outliers=1, levels="lloyd-max", **ROT, **OPTS)


def test_compiled_read_and_fused_decode_with_rotation():
    """The compiled read equals the eager one (the matmul by R^T and fused multiply-adds may round differently
    before the bf16 cast); the fused decode un-rotates the weighted sum of values once ((P V R) R^T): the same output
    as qcache_fp32 attention over the un-rotated keys/values `read()` returns."""
    fused = compiled_matches_eager(make_model("llama").config, **COMPILED)
    fused_decode_matches_read(fused.layers[0], 73)


# --- what the cache holds ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,kwargs", [
    ("llama", dict(bits=4, **ROT)),
    ("llama", dict(bits=2, outliers=1, levels="lloyd-max", **ROT)),
    ("gemma3", dict(bits=4, sliding_layers="quantized", **ROT)),
])
def test_memory_counts_one_rotation_matrix(family, kwargs):
    model = make_model(family)
    cache = QuantCache(**kwargs, **OPTS)
    generate(model, prompt(90), cache, max_new_tokens=10)
    mem = cache.memory()
    assert mem.rotation == 32 * 32 * 4  # one fp32 [D, D] matrix for every layer
    assert mem.total == reachable_bytes(cache)
    layers = [layer for layer in cache.layers if hasattr(layer, "consts")]
    assert all(layer.consts["k"]["rotation"] is layers[0].consts["v"]["rotation"] for layer in layers)


def test_default_options_rotate_values_only():
    model = make_model("llama")
    cache = QuantCache(bits=4, **OPTS)
    generate(model, prompt(40), cache, max_new_tokens=2)
    assert cache.memory().rotation == 32 * 32 * 4 and "rotation" not in cache.layers[0].consts["k"]
    assert not cache.layers[0].k_codec.rotation and cache.layers[0].v_codec.rotation
    plain = QuantCache(bits=4, rotation="none", rotate="kv", **OPTS)
    generate(model, prompt(40), plain, max_new_tokens=2)
    assert plain.memory().rotation == 0 and not plain.layers[0].v_codec.rotation


# --- crop and beam search --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("remove", [3, 20])
def test_crop_with_rotation(remove):
    """Crop into the residual and through a quantized block (its kept tokens go back un-rotated, in full precision);
    the next step matches DynamicCache as the 8-bit cache does."""
    model = make_model("llama")
    ids = prompt(62)
    cache = QuantCache(bits=8, **ROT, **OPTS)
    logits(model, ids, cache)
    cache.crop(-remove)
    kept = 62 - remove
    assert cache.get_seq_length() == kept
    out = logits(model, ids[:, kept:kept + 1], cache)
    ref = logits(model, ids[:, :kept + 1], DynamicCache(config=model.config))[:, -1:]
    assert (out - ref).abs().max() <= 0.05 * ref.std()


def test_beam_search_with_rotation_matches_dynamic():
    model = make_model("llama")
    ids = prompt(50)
    kw = dict(num_beams=3, max_new_tokens=16)
    ref = generate(model, ids, DynamicCache(config=model.config), **kw)
    out = generate(model, ids, QuantCache(bits=8, **ROT, **OPTS), **kw)
    assert torch.equal(out, ref)
