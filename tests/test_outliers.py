"""Dense-and-sparse outliers (QuantCacheConfig.outliers): the farthest values of each group are kept exactly."""

import pytest
import torch

from qcache import layout
from qcache.presets import recipe
from qcache.tools.footprint import reachable_bytes

from conftest import make_model
from qcache import QuantCache, QuantCacheConfig
from qcache.quant import dequantize_grouped, quantize_grouped, scatter_outliers, select_outliers

# unrotated (outliers are the alternative to a rotation for min-max groups)
OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2, rotation="none", rotate="kv")


def test_select_outliers_finds_the_farthest_values():
    x = torch.zeros(2, 8)
    x[0, 3], x[1, 6] = 50.0, -40.0
    x[0, :] += torch.arange(8) * 0.1
    idx, vals, keep = select_outliers(x, 1, 8, dim=1)
    assert idx.flatten().tolist() == [3, 6] and vals.flatten().tolist() == [x[0, 3].item(), -40.0]
    assert keep.sum() == 14 and not keep[0, 3] and not keep[1, 6]
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 3] = False  # padding is never an outlier and stays out of the range
    idx, _, keep = select_outliers(x, 1, 8, dim=1, mask=mask)
    assert idx[0, 0, 0] != 3 and not keep[0, 3] and keep.sum() == 13  # 16 - 1 padding - 2 outliers
    with pytest.raises(ValueError, match=r"outliers=8 per group must be in \[1, 7\]"):
        select_outliers(x, 8, 8, dim=1)


def test_outliers_cut_the_error_of_a_spiky_group():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g)
    x[torch.arange(64), torch.randint(0, 64, (64,), generator=g)] = 30.0  # one spike per row
    plain = dequantize_grouped(*quantize_grouped(x, 2, 64, dim=1), 64, dim=1)
    idx, vals, keep = select_outliers(x, 1, 64, dim=1)
    codes, scale, zero = quantize_grouped(x, 2, 64, dim=1, mask=keep)
    sparse = dequantize_grouped(codes, scale, zero, 64, dim=1)
    scatter_outliers(sparse.view(64, 1, 64), 2, idx, vals)
    assert torch.equal(sparse[~keep], x[~keep])  # the spikes come back exactly
    assert (sparse - x).pow(2).mean() < 0.1 * (plain - x).pow(2).mean()


def test_cache_with_outliers_is_closer_and_counts_its_bytes():
    model = make_model("llama")
    ids = torch.randint(2, 96, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        errs = {}
        for m in (0, 2):
            cache = QuantCache(bits=2, outliers=m, levels="uniform", **OPTS)
            model(ids[:, :50], cache=cache, use_cache=True)  # then the rest reads its codes
            errs[m] = (model(ids[:, 50:], cache=cache, use_cache=True).logits - ref[:, 50:]).pow(2).mean()
    assert errs[2] < errs[0]
    store = cache.layers[0].store
    nb, tq = store.length("block"), store.length("token")
    assert store.view("k_out_idx").shape == (1, 2, nb, 2, 32) and store.view("v_out_idx").shape == (1, 2, tq, 2, 2)
    mem = cache.memory()
    assert mem.outliers == 2 * 2 * 2 * (nb * 32 + tq * 2) * (4 + 1)  # layers x heads x m x count x (fp32 + offset)
    expected = layout.bytes_per_token(recipe(bits=2, outliers=2, levels="uniform", **OPTS),
        2, 2, 32, 150, fp_bytes=4) * 150
    assert mem.total - mem.reserved - mem.rope - mem.rotation == pytest.approx(expected)  # (rotation: the window keys' matrix)
    assert mem.total == reachable_bytes(cache)


def test_outliers_survive_crop_beam_and_sliding_eviction():
    model = make_model("llama")
    ids = torch.randint(2, 96, (2, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model.generate(ids, cache=QuantCache(bits=2, outliers=1, **OPTS), max_new_tokens=6, num_beams=2,
                             do_sample=False, pad_token_id=0)
    assert out.shape == (2, 76)
    cache = QuantCache(bits=4, outliers=1, **OPTS)
    with torch.no_grad():
        model(ids[:1], cache=cache, use_cache=True)
        layer = cache.layers[0]
        held, residual = layer.stored_length(), layer.store.length("residual")
        cache.crop(-(residual + 8))  # through the last block
        assert layer.stored_length() == held - residual - 8
        assert layer.store.length("residual") == 8  # the cut block's 8 kept tokens, back in full precision
        assert layer.store.length("block") * 16 == layer.store.length("token")  # whole blocks only
        assert layer.store.view("k_out_idx").shape[2] == layer.store.length("block")
        keys, _ = layer.read()
        assert torch.isfinite(keys).all()
        model(ids[:1, 62:63], cache=cache, use_cache=True)  # keeps working
    gemma = make_model("gemma3")
    cache = QuantCache(bits=4, outliers=1, sliding_layers="quantized", **OPTS)
    with torch.no_grad():
        gemma.generate(ids[:1, :60], cache=cache, max_new_tokens=30, do_sample=False, pad_token_id=0)
    sliding = next(layer for layer in cache.layers if layer.is_sliding)
    store = sliding.store
    assert sliding.dropped > 0  # blocks were evicted from the front
    assert store.view("k_out_idx").shape[2] == store.length("block") and store.view("v_out_idx").shape[2] == \
        store.length("token")


def test_outlier_options_are_checked():
    with pytest.raises(ValueError, match="outliers=16 must be smaller than every group"):
        QuantCacheConfig(outliers=16, k_group_size=16, v_scale="minmax", v_group_size=16)
    with pytest.raises(ValueError, match="not supported with static_keys=True"):
        QuantCacheConfig(outliers=1, static_keys=True, v_scale="minmax")
    with pytest.raises(ValueError, match="at most 256"):
        QuantCacheConfig(outliers=1, k_group_size=512, v_scale="minmax")
    with pytest.raises(ValueError, match=r"v_scale='norm' scales whole heads .*got outliers=1"):
        QuantCacheConfig(outliers=1)  # the default values have no groups to keep outliers out of


def test_calibration_samples_leave_outliers_out():
    from calibration.fit import key_samples, value_samples

    keys = torch.randn(1, 32, 4, generator=torch.Generator().manual_seed(0))
    keys[0, 5, 2] = 100.0
    u, w = key_samples(keys, torch.ones(1, 4), 16, outliers=1)  # [H, blocks, G, D]
    assert w[0, 0, 5, 2] == 0 and (w > 0).sum() == 32 * 4 - 2 * 4  # one outlier per channel per block
    assert u.max() <= 1 and u.min() >= 0
    assert w[0, 0, :, 2].max() < 100  # weight = range^2: the range no longer spans the spike (>= 100^2 if it did)
    values = keys.clone()
    u, w = value_samples(values, torch.ones(1, 32), 4, outliers=1)  # [H, N, groups, g]
    assert w[0, 5, 0, 2] == 0 and (w == 0).sum() == 32
