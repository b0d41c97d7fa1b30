"""kernel="compiled" (qcache/kernels.py) reads the same keys/values as the eager path, and is really used; with the
qcache_fp32 attention it attends from the codes (decode_attention) to the same output as attention over the read."""

import pytest
import torch

from conftest import make_model
from kv_checks import same_greedy_run
from qcache import QuantCache, QuantCacheConfig, kernels
from qcache.attention import fp32_sdpa_attention_forward, use_fp32_attention
from qcache.codec import ValueCodec
from qcache.handover import HeldStates
from qcache.quant import code_planes, dequantize, pack

OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2)


def _feed(cache, steps, batch=1, seed=0, dtype=torch.bfloat16, start=0, positions=None, chunks=(70,)):
    """Random states through layer 0 of `cache`: a 70-token prefill (or `chunks` of tokens: the first one into the
    empty cache attends to its own states, the next ones read the cache) then `steps` single tokens; the reads."""
    g = torch.Generator().manual_seed(seed)
    H, D = cache._text_config.num_key_value_heads, cache._text_config.head_dim
    outs, pos = [], start
    for n in list(chunks) + [1] * steps:
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

    def counting(name, *variant):
        fn = original(name, *variant)

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
    # the 20 steps read through the compiled functions; the prefill into the empty cache attends to its own states
    assert compiled_calls.count("read_keys") == 20 and compiled_calls.count("read_values") == 20
    assert torch.equal(_feed(QuantCache(config, bits=bits, outliers=outliers, **OPTS), 0)[0][0],
                       _feed(QuantCache(config, bits=2, **OPTS), 0)[0][0])


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


def test_every_layout_reads_compiled(compiled_calls):
    """Rows at different positions (left padding) and a crop through a block read through the same compiled
    functions, with the eager path's values."""
    config = make_model("llama").config

    def padded(pos, n):  # row 1 starts 3 tokens later: its first 3 positions are padding (given as 0)
        p = torch.arange(pos, pos + n)[None].repeat(2, 1)
        p[1] -= 3
        return p.clamp(min=0)

    eager = QuantCache(config, bits=4, **OPTS)
    fused = QuantCache(config, bits=4, kernel="compiled", **OPTS)
    for (ke, _), (kf, _) in zip(_feed(eager, 3, batch=2, positions=padded), _feed(fused, 3, batch=2, positions=padded)):
        torch.testing.assert_close(kf, ke, rtol=2**-7, atol=1e-3)
    assert fused.layers[0].first.tolist() == [0, -3] and compiled_calls.count("read_keys") == 3  # not the prefill

    eager = QuantCache(config, bits=4, **OPTS)
    fused = QuantCache(config, bits=4, kernel="compiled", **OPTS)
    for cache in (eager, fused):
        _feed(cache, 0)
        cache.crop(-(cache.layers[0].store.length("residual") + 8))  # the residual and half of the last block
    ke, kf = eager.layers[0].read()[0], fused.layers[0].read()[0]
    torch.testing.assert_close(kf, ke, rtol=2**-7, atol=1e-3)
    assert compiled_calls.count("read_keys") >= 5


def test_kernel_option_is_checked():
    with pytest.raises(ValueError, match=r"kernel=.triton.*allowed values: \[.auto., .eager., .compiled., .native.\]"):
        QuantCacheConfig(kernel="triton")


def _lazy_layer(bits, outliers=0, batch=1, codebooks=None, v_group_size=16):
    """Layer 0 of a compiled cache fed 70 + 5 tokens (its decode steps hand attention a DecodeStep)."""
    config = make_model("llama").config
    cache = QuantCache(config, bits=bits, outliers=outliers, kernel="compiled",
                       **{**OPTS, "v_group_size": v_group_size})
    _feed(cache, 5, batch=batch)
    return cache, cache.layers[0]


# 4, 2 and 8 bits here; the 3-bit fused decode is checked by tests/test_norm_values.py's compiled test (each
# configuration compiles for tens of seconds on a CPU)
@pytest.mark.parametrize("bits,outliers,v_group", [(4, 1, 32), (2, 2, 32), (8, 0, 16)])
def test_decode_attention_equals_attention_over_the_read(bits, outliers, v_group):
    """One query token attended from the codes == qcache_fp32 attention over the keys/values `read()` returns (same
    fp32 dequantized values, rounded to bf16 there: so within bf16 rounding), with a padding mask."""
    cache, layer = _lazy_layer(bits, outliers, batch=2, v_group_size=v_group)
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(2, 2, 1, 32, generator=g).to(torch.bfloat16) for _ in range(2))
    keys, values = layer.update(k, v, kwargs={"position_ids": torch.tensor([[75], [75]])})
    assert isinstance(keys, HeldStates) and keys.step.layer is layer and keys.step is values.step
    assert keys.step.fp_k.shape[2] == layer.store.length("sink") + layer.store.length("residual")
    full_k, full_v = layer.read()
    assert keys.shape == full_k.shape and values.shape == full_v.shape and keys.dtype == full_k.dtype
    T = full_k.shape[2]
    assert T == 76 and layer.quantized_length > 0
    query = torch.randn(2, 4, 1, 32, generator=g).to(torch.bfloat16)
    mask = torch.ones(2, 1, 1, T, dtype=torch.bool)
    mask[1, ..., :5] = False  # some keys hidden from row 1
    module = torch.nn.Module()
    for m in (None, mask):
        fused, _ = fp32_sdpa_attention_forward(module, query, keys, values, m, scaling=0.2)
        ref, _ = fp32_sdpa_attention_forward(module, query, full_k, full_v, m, scaling=0.2)
        assert fused.shape == ref.shape == (2, 1, 4, 32) and fused.dtype == torch.bfloat16
        torch.testing.assert_close(fused.float(), ref.float(), rtol=2**-7, atol=2e-3)
    # the mask is really applied: hiding keys changes row 1 only
    a, _ = fp32_sdpa_attention_forward(module, query, keys, values, None, scaling=0.2)
    b, _ = fp32_sdpa_attention_forward(module, query, keys, values, mask, scaling=0.2)
    assert torch.equal(a[0], b[0]) and not torch.allclose(a[1].float(), b[1].float(), atol=1e-3)


def test_decode_attention_rejects_a_mask_of_another_length():
    _, layer = _lazy_layer(4)
    keys, values = layer.update(*(torch.randn(1, 2, 1, 32).to(torch.bfloat16) for _ in range(2)),
                                kwargs={"position_ids": torch.tensor([[75]])})
    with pytest.raises(ValueError, match=r"mask of shape \(1, 1, 1, 10\).*76 cached tokens"):
        fp32_sdpa_attention_forward(torch.nn.Module(), torch.randn(1, 4, 1, 32), keys, values,
                                    torch.ones(1, 1, 1, 10, dtype=torch.bool))


def test_held_states_outside_decode_read_the_cache():
    """A decode step's HeldStates reaching attention with more than one query (or any other operation) are the
    layer's `read()`, exactly."""
    _, layer = _lazy_layer(4)
    keys, values = layer.update(*(torch.randn(1, 2, 1, 32).to(torch.bfloat16) for _ in range(2)),
                                kwargs={"position_ids": torch.tensor([[75]])})
    full_k, full_v = layer.read()
    query = torch.randn(1, 4, 3, 32)
    mask = torch.ones(1, 1, 3, full_k.shape[2], dtype=torch.bool)
    out, _ = fp32_sdpa_attention_forward(torch.nn.Module(), query, keys, values, mask)
    ref, _ = fp32_sdpa_attention_forward(torch.nn.Module(), query, full_k, full_v, mask)
    assert torch.equal(out, ref) and keys.step.fused == 0
    # any torch operation sees the dense tensors: eager attention's matmul, a transpose, a sum
    assert torch.equal(keys.transpose(2, 3), full_k.transpose(2, 3)) and torch.equal(values.sum(), full_v.sum())
    assert type(keys.transpose(2, 3)) is torch.Tensor


@pytest.mark.parametrize("packed", [False, True])
def test_stock_sdpa_attends_from_the_codes(packed):
    """torch's scaled_dot_product_attention on a decode step's HeldStates (as transformers' sdpa calls it: GQA via
    enable_gqa without a mask, or the query heads packed into rows with one) attends from the codes, and equals
    fp32 attention over `read()` within bf16 rounding of the output."""
    import torch.nn.functional as F

    _, layer = _lazy_layer(4, batch=2)
    g = torch.Generator().manual_seed(2)
    keys, values = layer.update(*(torch.randn(2, 2, 1, 32, generator=g).to(torch.bfloat16) for _ in range(2)),
                                kwargs={"position_ids": torch.tensor([[75], [75]])})
    full_k, full_v = (t.float() for t in layer.read())
    query = torch.randn(2, 4, 1, 32, generator=g).to(torch.bfloat16)
    mask = torch.ones(2, 1, 1, 76, dtype=torch.bool)
    mask[1, ..., :7] = False
    ref = F.scaled_dot_product_attention(query.float(), full_k, full_v, attn_mask=mask, enable_gqa=True)
    if packed:
        got = F.scaled_dot_product_attention(query.reshape(2, 2, 2, 32), keys, values, attn_mask=mask)
        got = got.reshape(2, 4, 1, 32)
    else:
        got = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
    assert keys.step.fused == 1 and got.dtype == torch.bfloat16 and type(got) is torch.Tensor
    torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=2e-3)


@pytest.mark.parametrize("family,bits,outliers,quant_layers", [("llama", 2, 1, 2), ("gemma3", 4, 0, 1)])
def test_fused_attention_generate_same_tokens(family, bits, outliers, quant_layers, compiled_calls):
    """generate with qcache_fp32: compiled cache + fused decode attention gives the eager cache's tokens, and the
    fused path served every decode step of every quantized layer (Gemma 3: its one full-attention layer; the
    sliding ones are native)."""
    model = use_fp32_attention(make_model(family, dtype=torch.bfloat16))
    ids = torch.randint(2, 96, (1, 120), generator=torch.Generator().manual_seed(3))
    outs = []
    for kernel in ("eager", "compiled"):
        with torch.no_grad():
            outs.append(model.generate(ids, cache=QuantCache(bits=bits, outliers=outliers, kernel=kernel,
                                                                       **OPTS),
                                       max_new_tokens=8, do_sample=False, pad_token_id=0))
    assert torch.equal(outs[0], outs[1])
    assert compiled_calls.count("decode_attention") == 7 * quant_layers  # 7 decode steps x quantized layers
    assert "read_keys" not in compiled_calls[compiled_calls.index("decode_attention"):]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_literal_line_decodes_like_the_eager_read(attn, compiled_calls):
    """`generate(..., past_key_values=QuantCache(bits=4))` with the model's own attention and no other opt-in: the
    compiled cache gives the eager cache's tokens. Under stock sdpa every decode step of every layer attends from
    the codes; under eager attention (which multiplies the keys itself) it reads them, as before."""
    model = make_model("llama", dtype=torch.bfloat16)
    model.set_attn_implementation(attn)
    ids = torch.randint(2, 96, (1, 120), generator=torch.Generator().manual_seed(3))
    outs = []
    for kernel in ("eager", "compiled"):
        with torch.no_grad():
            out = model.generate(ids, past_key_values=QuantCache(bits=4, kernel=kernel, **OPTS), max_new_tokens=8,
                                 do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        outs.append((out.sequences[0, 120:], torch.cat(out.logits).float()))  # [8], [8, V]
    (eager_tokens, eager_logits), (tokens, logits) = outs
    same_greedy_run(tokens, logits, eager_tokens, eager_logits)
    assert compiled_calls.count("decode_attention") == (7 * 2 if attn == "sdpa" else 0)


def test_packing_is_planar():
    """Byte j of 4-bit codes holds channels j (low nibble) and j + n/2 (high): a RoPE pair of a key."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)[None, :16]
    packed = pack(codes, 4)
    assert packed.shape[-1] == 8
    assert torch.equal(packed & 0xF, codes[:, :8]) and torch.equal(packed >> 4, codes[:, 8:])
    for bits in (2, 3, 4, 8):
        c = torch.randint(0, 2**bits, (2, 3, 64), dtype=torch.uint8)
        assert torch.equal(torch.cat(code_planes(pack(c, bits), bits), -1), c)


def test_value_planes_when_groups_do_not_nest():
    """head_dim 48 in value groups of 16 with 4-bit planes of 24 channels: one plane, same values."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (1, 2, 5, 48), generator=g, dtype=torch.uint8)
    scale, zero = torch.rand(1, 2, 5, 3, generator=g), torch.rand(1, 2, 5, 3, generator=g)
    codec = ValueCodec(bits=4, group=16, scale_dtype=torch.float32)
    got = torch.cat(codec.planes({"v_codes": pack(codes, 4), "v_scale": scale, "v_zero": zero}, {}), dim=-1)
    ref = dequantize(codes.view(1, 2, 5, 3, 16), scale[..., None], zero[..., None]).view(1, 2, 5, 48)
    assert torch.equal(got, ref)


def test_each_cache_configuration_compiles_on_its_own_code():
    """torch.compile's recompile limit (8) is per code object: one per configuration, so a process that runs many
    configurations (an eval sweep) does not fall back to uncompiled reads."""
    a, b = kernels.compiled("read_values", ("x",)), kernels.compiled("read_values", ("y",))
    assert a is not b and kernels.compiled("read_values", ("x",)) is a
    copy = kernels._own_code(kernels.read_values)
    assert copy.__code__ is not kernels.read_values.__code__ and copy.__code__.co_code == kernels.read_values.__code__.co_code
    _, layer = _lazy_layer(4)
    other = QuantCache(make_model("llama").config, bits=2, kernel="compiled", **OPTS)
    _feed(other, 0)
    assert layer._kernel_variant != other.layers[0]._kernel_variant


def test_a_failed_compile_names_the_way_out(monkeypatch):
    """No C++ compiler (or any backend failure): a RuntimeError naming kernel='eager', not an inductor traceback."""
    def broken(fn, **kwargs):
        def call(*args):
            raise torch._dynamo.exc.BackendCompilerFailed(fn, RuntimeError("cc1plus: not found"), None)
        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(kernels, "_COMPILED", {})
    config = make_model("llama").config
    with pytest.raises(RuntimeError, match=r"kernel='compiled'.*read_keys.*kernel='eager'"):
        _feed(QuantCache(config, bits=4, kernel="compiled", **OPTS), 0, chunks=(70, 5))


def test_auto_kernel_is_compiled_where_torch_compile_works(monkeypatch, caplog):
    """kernel="auto" (the default) reads with the compiled kernels where torch.compile works on the device, and says
    so once at INFO; where it cannot build, it reads eagerly and says why: never a silent slow path."""
    import logging

    monkeypatch.delenv("QCACHE_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "_COMPILER_WORKS", {})
    with caplog.at_level(logging.INFO, logger="qcache.kernels"):
        assert kernels.resolve_kernel("auto", torch.device("cpu")) == "compiled"
        assert kernels.resolve_kernel("auto", torch.device("cpu")) == "compiled"  # probed once
    assert len([r for r in caplog.records if "compile" in r.getMessage()]) == 1
    assert QuantCacheConfig().kernel == "auto"

    def broken(fn, **kwargs):
        def call(*args):
            raise torch._dynamo.exc.BackendCompilerFailed(fn, RuntimeError("cc1plus: not found"), None)
        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(kernels, "_COMPILER_WORKS", {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="qcache.kernels"):
        assert kernels.resolve_kernel("auto", torch.device("cpu")) == "eager"
    assert "reads the cache eagerly" in caplog.text and "cc1plus" in caplog.text
    assert kernels.resolve_kernel("compiled", torch.device("cpu")) == "compiled"  # explicit choices stay
    monkeypatch.setenv("QCACHE_KERNEL", "compiled")
    assert kernels.resolve_kernel("auto", torch.device("cpu")) == "compiled"
    monkeypatch.setenv("QCACHE_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"QCACHE_KERNEL='fast'.*\['eager', 'compiled', 'native'\]"):
        kernels.resolve_kernel("auto", torch.device("cpu"))


def test_default_cache_reads_compiled(monkeypatch, compiled_calls):
    """QuantCache(bits=4) as a user writes it takes the compiled read here (torch.compile works on this machine)."""
    monkeypatch.delenv("QCACHE_KERNEL", raising=False)
    monkeypatch.setattr(kernels, "_COMPILER_WORKS", {})
    model = make_model("llama")
    cache = QuantCache(bits=4, **OPTS)
    ids = torch.randint(2, 96, (1, 60))
    with torch.no_grad():  # a second turn: its prompt reads what the first left in the cache
        model(ids[:, :40], cache=cache, use_cache=True)
        model(ids[:, 40:], cache=cache, use_cache=True)
    assert cache.layers[0].kernel == "compiled" and "read_keys" in compiled_calls
