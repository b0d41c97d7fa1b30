"""kernel="compiled" (qcache/kernels.py) reads the same keys/values as the eager path, and is really used."""

import pytest
import torch

from conftest import make_model
from qcache import QuantCache, QuantCacheConfig, kernels
from qcache.cache import _extend_run

OPTS = dict(k_group_size=16, v_group_size=16, recent_tokens=4, sink_tokens=2)


def _feed(cache, steps, batch=1, seed=0, dtype=torch.bfloat16, start=0, positions=None):
    """Random states through layer 0 of `cache`: a 70-token prefill then `steps` single tokens; the reads."""
    g = torch.Generator().manual_seed(seed)
    H, D = cache._text_config.num_key_value_heads, cache._text_config.head_dim
    outs, pos = [], start
    for n in [70] + [1] * steps:
        k, v = (torch.randn(batch, H, n, D, generator=g).to(dtype) for _ in range(2))
        p = torch.arange(pos, pos + n)[None].expand(batch, n) if positions is None else positions(pos, n)
        outs.append(cache.update(k, v, 0, kwargs={"position_ids": p}))
        pos += n
    return outs


@pytest.fixture
def compiled_calls(monkeypatch):
    """Count the calls of the compiled read functions."""
    calls = []
    original = kernels.compiled

    def counting(name):
        fn = original(name)

        def call(*args):
            calls.append(name)
            return fn(*args)
        return call

    monkeypatch.setattr(kernels, "compiled", counting)
    return calls


@pytest.mark.parametrize("bits,outliers", [(4, 0), (3, 0), (2, 1)])
def test_compiled_read_equals_eager(bits, outliers, compiled_calls):
    config = make_model("llama").config
    eager = QuantCache(config, bits=bits, outliers=outliers, **OPTS)
    fused = QuantCache(config, bits=bits, outliers=outliers, kernel="compiled", **OPTS)
    for (ke, ve), (kf, vf) in zip(_feed(eager, 20), _feed(fused, 20)):
        assert ke.shape == kf.shape and ke.dtype == kf.dtype == torch.bfloat16
        # fp32 arithmetic in both; a fused multiply-add may differ in the last fp32 bit before the bf16 rounding
        torch.testing.assert_close(kf, ke, rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(vf, ve, rtol=2**-7, atol=1e-3)
    assert fused.layers[0].quantized_length > 0
    assert compiled_calls.count("read_keys") == 21 and compiled_calls.count("read_values") == 21


def test_compiled_generate_same_tokens(compiled_calls):
    model = make_model("llama")
    ids = torch.randint(2, 96, (1, 120), generator=torch.Generator().manual_seed(3))
    outs = []
    for kernel in ("eager", "compiled"):
        with torch.no_grad():
            outs.append(model.generate(ids, cache=QuantCache(bits=4, kernel=kernel, **OPTS), max_new_tokens=10,
                                       do_sample=False, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])
    assert compiled_calls  # the fused path served the compiled cache


def test_layouts_outside_the_kernel_read_eagerly(compiled_calls):
    """Rows at different positions (left padding) and a crop through a block use the eager code: same values."""
    config = make_model("llama").config

    def padded(pos, n):  # row 1 starts 3 tokens later: its first 3 positions are padding
        p = torch.arange(pos, pos + n)[None].repeat(2, 1)
        p[1] -= 3
        return p.clamp(min=0)

    eager = QuantCache(config, bits=4, **OPTS)
    fused = QuantCache(config, bits=4, kernel="compiled", **OPTS)
    for (ke, _), (kf, _) in zip(_feed(eager, 3, batch=2, positions=padded), _feed(fused, 3, batch=2, positions=padded)):
        assert torch.equal(ke, kf)
    assert fused.layers[0]._q_start is None and not compiled_calls

    fused = QuantCache(config, bits=4, kernel="compiled", **OPTS)
    _feed(fused, 0)
    fused.crop(-(fused.layers[0].res_k.shape[2] + 8))  # the residual and half of the last 16-token block
    assert not fused.layers[0]._uniform_blocks and not fused.layers[0]._fused_layout()


def test_extend_run():
    run = torch.arange(5, 9)[None].repeat(2, 1)
    assert _extend_run(None, 0, run) == 5
    assert _extend_run(5, 4, torch.arange(9, 11)[None]) == 5
    assert _extend_run(5, 4, torch.arange(10, 12)[None]) is None  # a gap
    assert _extend_run(None, 0, torch.tensor([[-1, 0, 1], [0, 1, 2]])) is None  # rows differ (padding)
    assert _extend_run(None, 4, torch.arange(9, 11)[None]) is None  # an earlier break stays broken


def test_kernel_option_is_checked():
    with pytest.raises(ValueError, match=r"kernel='triton'.*allowed values: \['eager', 'compiled'\]"):
        QuantCacheConfig(kernel="triton")
