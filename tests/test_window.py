"""window_bits=8: the residual window (recent tokens and the block being filled) held 8-bit per token. It reads back
within 8-bit error, costs what `bytes_per_token` says, and works with crop and beam search (the compiled read and
the fused decode with it: tests/test_norm_values.py)."""

import pytest
import torch
from transformers import DynamicCache

from conftest import make_model
from qcache import layout
from qcache.presets import recipe
from qcache import QuantCache, QuantCacheConfig
from qcache.tools.footprint import reachable_bytes
from test_cache import assert_greedy_agrees, generate, logits, prompt

OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2)


def test_bad_window_bits_raise():
    with pytest.raises(ValueError, match=r"window_bits=4 is not supported; allowed values: \[16, 8\]"):
        QuantCacheConfig(window_bits=4)


@pytest.mark.parametrize("window_keys", ["rotated", "minmax"])
def test_window_reads_back_within_8bit_error_and_sinks_stay_exact(window_keys):
    config = make_model("llama").config
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 30, 32), torch.randn(1, 2, 30, 32)
    cache = QuantCache(config, bits=4, window_bits=8, window_keys=window_keys, **OPTS)
    cache.update(k, v, 0, kwargs={"position_ids": torch.arange(30)[None]})
    layer = cache.layers[0]
    S, Tq = layer.store.length("sink"), layer.quantized_length
    rk, rv = layer.read()
    assert torch.equal(rk[:, :, :S], k[:, :, :S])  # sinks: as given
    w = slice(S + Tq, 30)  # the window: 8-bit, error at most half a step of each token's range (rotated keys: in
    # the rotated space, where the range is taken; the rotation is orthogonal, so the error's norm is the same)
    R = layer.window_consts[0]["rotation"] if window_keys == "rotated" else torch.eye(32)
    for got, want, rot in ((rk, k, R), (rv, v, torch.eye(32))):
        coded = want[:, :, w] @ rot
        step = (coded.amax(-1, keepdim=True) - coded.amin(-1, keepdim=True)) / 255
        assert bool(((got[:, :, w] @ rot - coded).abs() <= step * 0.5 + 1e-3).all())
        assert not torch.equal(got[:, :, w], want[:, :, w])


def test_rotated_window_keys_keep_the_channels_beside_an_outlier():
    """A key channel 100x the others (Qwen2.5's k_proj biases make such channels): one range per token across the
    channels rounds every other channel by ~100/255 of their size; rotated first, the outlier's energy is spread and
    the other channels keep less than half the error (D=32 here; the gain grows with head_dim)."""
    config = make_model("llama").config
    torch.manual_seed(0)
    k, v = torch.randn(1, 2, 30, 32), torch.randn(1, 2, 30, 32)
    k[..., 5] *= 100
    errors = {}
    for window_keys in ("rotated", "minmax"):
        cache = QuantCache(config, bits=4, window_bits=8, window_keys=window_keys, **OPTS)
        cache.update(k, v, 0, kwargs={"position_ids": torch.arange(30)[None]})
        layer = cache.layers[0]
        w = slice(layer.store.length("sink") + layer.quantized_length, 30)
        rk, _ = layer.read()
        others = [c for c in range(32) if c != 5]
        errors[window_keys] = float((rk[:, :, w, others] - k[:, :, w, others]).pow(2).mean().sqrt())
    assert errors["rotated"] * 2 < errors["minmax"]


def test_bad_window_keys_raise():
    with pytest.raises(ValueError, match=r"window_keys='pca' is not supported; allowed values: \['rotated', 'minmax'\]"):
        QuantCacheConfig(window_keys="pca")


@pytest.mark.parametrize("bits", [4, 2])
def test_window_bytes_are_counted(bits):
    model = make_model("llama")
    cache = QuantCache(bits=bits, window_bits=8, **OPTS)
    logits(model, prompt(150), cache)
    mem = cache.memory()
    heads, head_dim, layers = 2, 32, 2
    expected = layout.bytes_per_token(recipe(bits=bits, window_bits=8, **OPTS), layers, heads, head_dim, 150,
                                                                                  fp_bytes=4) * 150
    assert mem.total - mem.reserved - mem.rope - mem.rotation - mem.codebooks == pytest.approx(expected)
    assert mem.total == reachable_bytes(cache)
    plain = QuantCache(bits=bits, window_bits=16, **OPTS)
    logits(model, prompt(150), plain)
    assert mem.total < plain.memory().total


def test_8bit_window_forward_generate_crop_and_beams():
    model = make_model("llama")
    ids = prompt(90)
    ref = logits(model, ids, DynamicCache(config=model.config))
    out = logits(model, ids, QuantCache(bits=8, window_bits=8, **OPTS))
    assert (out - ref).abs().max() <= 0.05 * ref.std()
    seq = generate(model, prompt(60), QuantCache(bits=8, window_bits=8, **OPTS), max_new_tokens=10)
    assert_greedy_agrees(model, seq, 60)
    for remove in (3, 20):  # into the window, and through a quantized block
        cache = QuantCache(bits=8, window_bits=8, **OPTS)
        logits(model, ids[:, :62], cache)
        cache.crop(-remove)
        kept = 62 - remove
        out = logits(model, ids[:, kept:kept + 1], cache)
        ref = logits(model, ids[:, :kept + 1], DynamicCache(config=model.config))[:, -1:]
        assert (out - ref).abs().max() <= 0.05 * ref.std()
    # beam search's reorder moves the window's codes with the rest: reading after a reorder is reordering the read
    cache = QuantCache(bits=4, window_bits=8, **OPTS)
    logits(model, prompt(40, batch=2), cache)
    before = [t.clone() for t in cache.layers[0].read()]
    cache.reorder_cache(torch.tensor([1, 0, 1]))
    after = cache.layers[0].read()
    for b, a in zip(before, after):
        assert torch.equal(a, b[[1, 0, 1]])
