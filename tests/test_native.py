"""kernel="native" (qcache/native.py, qcache/csrc/decode.c): the C decode attention over the packed codes gives the
numbers of `kernels.decode_attention` (the reference every other path is tested against) on every width and codec
it claims, is what `QuantCache(bits=4)` decodes with on CPU, and refuses what it cannot read instead of reading it
wrong."""

import logging

import pytest
import torch

from conftest import make_model
from kv_checks import same_greedy_run
from qcache import QuantCache, kernels, native
from qcache.handover import HeldStates

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler with OpenMP here")

SMALL = dict(k_group_size=16, recent_tokens=8, sink_tokens=2)


def _config(geometry):
    """Configs of the geometries the kernel must read: (family, head_dim, query heads, kv heads)."""
    from transformers import LlamaConfig, Qwen2Config, StableLmConfig

    if geometry == "tiny":
        return make_model("llama").config
    kind, D, heads, kv = geometry
    common = dict(hidden_size=heads * D, intermediate_size=64, num_hidden_layers=1, num_attention_heads=heads,
                  num_key_value_heads=kv, vocab_size=96)
    if kind == "stablelm":  # partial rotary: a quarter of the channels rotate
        return StableLmConfig(partial_rotary_factor=0.25, **common)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[kind](head_dim=D, **common)


def _layer(geometry="tiny", n=150, batch=2, seed=0, dtype=torch.bfloat16, **options):
    """Layer 0 of a cache fed `n` random tokens in one prefill: [sinks | quantized blocks | 8-bit window]."""
    config = _config(geometry)
    cache = QuantCache(config, kernel="eager", **{**SMALL, **options})
    g = torch.Generator().manual_seed(seed)
    H = config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    k, v = (torch.randn(batch, H, n, D, generator=g).to(dtype) * 2 for _ in range(2))
    k[..., 3] += 12  # an outlier key channel
    cache.update(k, v, 0, kwargs={"position_ids": torch.arange(n)[None].expand(batch, n)})
    return cache.layers[0]


def _both(layer, groups=3, mask=True, seed=1):
    """(native, reference) outputs of one decode query over everything the layer holds."""
    s = layer.store
    S = s.length("sink")
    res_k, res_v = layer._window()
    fp_k, fp_v = torch.cat([s.view("sink_k"), res_k], 2), torch.cat([s.view("sink_v"), res_v], 2)
    B, H, _, D = fp_k.shape
    T = S + s.length("token") + res_k.shape[2]
    query = torch.randn(B, H, groups, D, generator=torch.Generator().manual_seed(seed))
    bias = None
    if mask:
        bias = torch.zeros(B, 1, 1, T)
        bias[-1, ..., :21] = torch.finfo(torch.float32).min  # row B-1 does not see its first 21 tokens
    q = layer._quantized()
    args = (query, fp_k, fp_v, bias, q, S, D**-0.5, layer.k_codec, layer.v_codec)
    return native.decode_attention(*args), kernels.decode_attention(*args)


def _window_args(layer, groups=3, mask="additive", seed=1):
    """(native arguments with the window read from its codes, reference arguments with the window dequantized in
    fp32) of one decode query over everything the layer holds."""
    s = layer.store
    S = s.length("sink")
    (ck, cv), (kc, vc) = layer.window_codecs, layer.window_consts
    views = s.views("residual")
    window = native.Window({n: t for n, t in views.items() if n.startswith(ck.prefix)},
                           {n: t for n, t in views.items() if n.startswith(cv.prefix)}, ck, cv, kc, vc)
    # the reference's window: the same codes decoded in fp32 (not rounded to the cache dtype, as `_window` does)
    res_k, res_v = (torch.cat(c.planes(part, consts), dim=-1) for c, part, consts in
                    ((ck, window.k, kc), (cv, window.v, vc)))
    sink_k, sink_v = s.view("sink_k"), s.view("sink_v")
    B, H, R, D = res_k.shape
    T = S + s.length("token") + R
    query = torch.randn(B, H, groups, D, generator=torch.Generator().manual_seed(seed))
    bias = None
    if mask is not None:  # row B-1 is left-padded: it does not see its first 21 tokens (two sinks included)
        seen = torch.ones(B, 1, 1, T, dtype=torch.bool)
        seen[-1, ..., :21] = False
        bias = torch.zeros(B, 1, 1, T).masked_fill_(~seen, torch.finfo(torch.float32).min)
        mask = seen if mask == "bool" else bias
    q = layer._quantized()
    fp_k, fp_v = torch.cat([sink_k.float(), res_k], 2), torch.cat([sink_v.float(), res_v], 2)
    common = (q, S, D**-0.5, layer.k_codec, layer.v_codec)
    return (query, sink_k, sink_v, mask, *common, window), (query, fp_k, fp_v, bias, *common)


@pytest.mark.parametrize("window_keys", ["rotated", "minmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("geometry", ["tiny", ("llama", 64, 9, 3), ("qwen2", 128, 12, 2)],
                         ids=["tiny", "smollm2-like", "qwen2.5-like"])
def test_the_window_is_read_from_its_codes(window_keys, dtype, geometry):
    """The 8-bit residual window attended from its codes (no dequantized copy) equals the reference over the same
    codes decoded in fp32: rotated and min-max window keys, sinks, two rows (one left-padded), GQA, head_dim 32, 64
    and 128, bf16, fp32 and fp16 caches; windows of 20 tokens (a partial tile) and of 8."""
    config = _config(geometry)
    G = config.num_attention_heads // config.num_key_value_heads
    for n in (150, 138):
        layer = _layer(geometry, n=n, dtype=dtype, window_keys=window_keys, rotate="kv")
        assert native.window_unsupported(layer.window_codecs, layer.window_consts) is None
        assert layer.store.length("residual") == {150: 20, 138: 8}[n] and layer.store.length("sink") == 2
        assert layer.window_codecs[0].rotation == (window_keys == "rotated")
        args, ref_args = _window_args(layer, groups=G)
        torch.testing.assert_close(native.decode_attention(*args), kernels.decode_attention(*ref_args),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{"bits": 4}, {"bits": 2, "rotate": "v", "v_scale": "minmax"},
                                     {"bits": 3, "scale_dtype": "bfloat16"}, {"bits": 4, "scale_dtype": "float32"},
                                     {"bits": 4, "rotation": "none", "rotate": "kv", "v_scale": "minmax"}],
                         ids=["defaults", "minmax-values", "bf16-scales", "fp32-scales", "no-region-rotation"])
@pytest.mark.parametrize("mask", [None, "additive", "bool"])
def test_the_window_from_its_codes_with_every_region_codec(options, mask):
    """The window read from its codes beside every region codec, scale dtype and mask form (none, additive, bool:
    the layer hands the C kernel the mask as attention gave it)."""
    layer = _layer(**options)
    args, ref_args = _window_args(layer, mask=mask)
    torch.testing.assert_close(native.decode_attention(*args), kernels.decode_attention(*ref_args),
                               rtol=1e-5, atol=1e-5)


def test_a_batch_one_mask_is_broadcast():
    layer = _layer(bits=4)
    args, ref_args = _window_args(layer, mask="bool")
    args = list(args)
    args[3] = args[3][:1]  # every row sees every token: one mask row for both
    ref_args = list(ref_args)
    ref_args[3] = torch.zeros_like(ref_args[3])
    torch.testing.assert_close(native.decode_attention(*args), kernels.decode_attention(*ref_args),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window_bits", [8, 16])
def test_a_native_decode_step_hands_over_the_window_as_codes(window_bits):
    """At a decode step a native layer with an 8-bit window hands over its sinks and the window's codes (no
    dequantized window); with window_bits=16 the residual as given. Either way attention over the step equals fp32
    attention over what `read()` gives (the window rounded to bf16 there), and `fp_k` still shows [sinks | window]."""
    from qcache.attention import fp32_sdpa_attention_forward

    config = make_model("llama").config
    cache = QuantCache(config, bits=4, kernel="native", window_bits=window_bits, **SMALL)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    for n, pos in ((70, 0), (1, 70)):
        k, v = (torch.randn(2, 2, n, 32, generator=g).to(torch.bfloat16) for _ in range(2))
        keys, values = cache.update(k, v, 0, kwargs={"position_ids": torch.arange(pos, pos + n)[None].expand(2, n)})
    step = keys.step
    S, R = layer.store.length("sink"), layer.store.length("residual")
    assert (step.window is not None) == (window_bits == 8) and step._fp[0].shape[2] == S + (0 if step.window else R)
    assert keys.shape == (2, 2, 71, 32) and keys.dtype == torch.bfloat16
    query = torch.randn(2, 4, 1, 32, generator=g).to(torch.bfloat16)
    mask = torch.ones(2, 1, 1, 71, dtype=torch.bool)
    mask[1, ..., :5] = False
    module = torch.nn.Module()
    out, _ = fp32_sdpa_attention_forward(module, query, keys, values, mask, scaling=0.2)
    assert step.fused == 1
    assert step.fp_k.shape[2] == S + R and step.fp_v.dtype == torch.bfloat16
    full_k, full_v = layer.read()
    ref, _ = fp32_sdpa_attention_forward(module, query, full_k, full_v, mask, scaling=0.2)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2e-3)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("options", [{}, {"rotate": "kv"}, {"rotate": "v", "v_scale": "minmax"},
                                     {"rotation": "none", "rotate": "kv", "v_scale": "minmax"}],
                         ids=["defaults", "rotated-keys", "minmax-values", "no-rotation"])
def test_native_equals_the_reference(bits, options):
    layer = _layer(bits=bits, **options)
    assert layer.quantized_length >= 128 and native.unsupported(layer.k_codec, layer.v_codec, 32, 3,
                                                                  layer.consts["k"]) is None
    out, ref = _both(layer)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("geometry", [("llama", 64, 9, 3), ("qwen2", 128, 12, 2), ("llama", 80, 4, 2),
                                      ("stablelm", 64, 4, 4)],
                         ids=["smollm2-like", "qwen2.5-like", "head_dim-80", "partial-rotary"])
def test_native_on_other_geometries(geometry):
    """SmolLM2's and Qwen2.5's head dims and GQA ratios, a head dim whose rotation has blocks of 16 channels, and a
    partial rotary width (StableLM: 16 of 64 channels rotate)."""
    _, _, heads, kv = geometry
    layer = _layer(geometry, bits=4, rotate="kv")
    out, ref = _both(layer, groups=heads // kv)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", [2, 3, 8])
@pytest.mark.parametrize("options", [{}, {"rotate": "v", "v_scale": "minmax"}], ids=["defaults", "minmax-values"])
def test_native_reads_every_width_at_head_dim_64(bits, options):
    """At head_dim 64 every width's value codes are read as whole 8-channel slices (3 bits: three byte planes of
    8 bytes), beside the bytewise unpacking of head_dim 32."""
    layer = _layer(("llama", 64, 9, 3), bits=bits, **options)
    out, ref = _both(layer)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_the_mask_is_applied():
    layer = _layer(bits=4)
    masked, _ = _both(layer, mask=True)
    plain, _ = _both(layer, mask=False)
    assert torch.equal(masked[0], plain[0]) and not torch.allclose(masked[-1], plain[-1], atol=1e-4)


def test_the_literal_line_decodes_natively(monkeypatch):
    """`generate(..., past_key_values=QuantCache(bits=4))` with stock sdpa and no other opt-in: every decode step of
    every layer attends through the C kernel (the 8-bit window read from its codes), and the tokens and logits are the
    eager read's (bf16 attention over the read there: a near tie may part, as in tests/test_kernels.py)."""
    monkeypatch.delenv("QCACHE_KERNEL", raising=False)
    calls = []
    real = native.decode_attention
    # (each call records whether the window came as its codes: the default 8-bit window does)
    monkeypatch.setattr(native, "decode_attention", lambda *a: calls.append(a[9] is not None) or real(*a))
    model = make_model("llama", dtype=torch.bfloat16)
    ids = torch.randint(2, 96, (1, 120), generator=torch.Generator().manual_seed(3))
    outs = []
    for kernel in ("eager", "auto"):
        with torch.no_grad():
            out = model.generate(ids, past_key_values=QuantCache(bits=4, kernel=kernel, **SMALL), max_new_tokens=8,
                                 do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        outs.append((out.sequences[0, 120:], torch.cat(out.logits).float()))
    (eager_tokens, eager_logits), (tokens, logits) = outs
    same_greedy_run(tokens, logits, eager_tokens, eager_logits)
    assert len(calls) == 7 * model.config.num_hidden_layers and all(calls)  # 7 decode steps x layers


def test_decode_step_hands_over_to_native():
    config = make_model("llama").config
    cache = QuantCache(config, bits=4, kernel="native", **SMALL)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    for n, pos in ((70, 0), (1, 70)):
        k, v = (torch.randn(1, 2, n, 32, generator=g).to(torch.bfloat16) for _ in range(2))
        keys, values = cache.update(k, v, 0, kwargs={"position_ids": torch.arange(pos, pos + n)[None]})
    assert layer.decode_kernel == "native" and isinstance(keys, HeldStates)
    out = torch.nn.functional.scaled_dot_product_attention(torch.randn(1, 4, 1, 32).to(torch.bfloat16), keys, values,
                                                           enable_gqa=True)
    assert keys.step.fused == 1 and out.shape == (1, 4, 1, 32)


def test_what_native_cannot_read_is_refused_or_left_to_the_compiled_decode(caplog, monkeypatch):
    """Outliers and static key ranges are not read by the C kernel: kernel='native' raises naming the allowed
    kernels; kernel='auto' decodes them with the compiled kernel and says why at INFO."""
    config = make_model("llama").config
    k = torch.randn(1, 2, 40, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"kernel='native' cannot serve this layer \(outliers\).*'compiled' or 'eager'"):
        QuantCache(config, bits=4, outliers=1, v_scale="minmax", kernel="native", **SMALL).update(
            k, k, 0, kwargs={"position_ids": torch.arange(40)[None]})
    monkeypatch.delenv("QCACHE_KERNEL", raising=False)  # (the suite's conftest sets it to eager)
    kernels._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="qcache.kernels"):
        cache = QuantCache(config, bits=4, outliers=1, v_scale="minmax", **SMALL)
        cache.update(k, k, 0, kwargs={"position_ids": torch.arange(40)[None]})
    assert cache.layers[0].decode_kernel == "compiled" and "outliers" in caplog.text
    with pytest.raises(ValueError, match=r"cannot read this layer's codes \(outliers\)"):
        native.decode_attention(torch.zeros(1, 2, 1, 32), None, None, None, cache.layers[0]._quantized(), 2, 1.0,
                                cache.layers[0].k_codec, cache.layers[0].v_codec)


def test_a_failed_build_names_the_way_out(monkeypatch, tmp_path):
    monkeypatch.setenv("QCACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-qcache")
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_error", None)
    assert not native.available()
    with pytest.raises(RuntimeError, match=r"no-such-compiler-qcache.*kernel='compiled' or kernel='eager'"):
        native._load()
    assert not list(tmp_path.rglob("*.so*"))  # nothing half-written stays behind


def test_the_library_is_built_once_into_qcache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("QCACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_error", None)
    assert native.available()
    built = list((tmp_path / "kernels").glob("decode-*.so"))
    assert built == [native.library_path()] and not list(tmp_path.rglob("*.tmp"))
    out, ref = _both(_layer(bits=4))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_the_roofline_bench_runs(tmp_path):
    """bench/decode_roofline.py on a short context: every row timed, its bandwidth positive and below what a copy
    moves many times over (a broken timing would give zero or absurd numbers)."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "decode_roofline.py"
    spec = importlib.util.spec_from_file_location("decode_roofline", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        # medians of 7: the two timings are taken apart, and on a loaded machine a median of 2 once put the C call
        # alone at 4x the whole call
        module.main(["--contexts", "512", "--repeats", "7", "--copy-mib", "16", "--threads", "1",
                     "--out", str(tmp_path / "r")])
    finally:
        torch.set_num_threads(threads)
    result = json.loads((tmp_path / "r.json").read_text())
    assert [r["geometry"] for r in result["rows"]] == ["smollm2-135m", "qwen2.5-coder-1.5b"]
    for r in result["rows"]:
        assert r["quantized_tokens"] >= 256 and r["bytes_read"] > 0
        assert 0 < r["c_gb_s"] < 100 * result["copy_gb_s"] and r["total_ms"] >= r["c_ms"] * 0.5
    assert "C / copy" in (tmp_path / "r.md").read_text()


def test_the_portable_build_gives_the_same_numbers(monkeypatch, tmp_path):
    """Built without AVX2 (as on a CPU without it: lane loops instead of permutes and byte loads), the kernel gives
    the reference's numbers too."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 flag")
    monkeypatch.setenv("QCACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_FLAGS", native._FLAGS + ["-mno-avx2"])
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_error", None)
    assert native.available()
    out, ref = _both(_layer(("llama", 64, 9, 3), bits=4))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    args, ref_args = _window_args(_layer(bits=4))
    torch.testing.assert_close(native.decode_attention(*args), kernels.decode_attention(*ref_args),
                               rtol=1e-5, atol=1e-5)


def test_the_rotation_fold_follows_each_matrix():
    """The butterfly's signs are read from each rotation matrix itself: two caches with other rotation seeds (one
    freed before the other is built, so its memory may be reused) each get their own, and a matrix that is not a
    randomized Hadamard gets none."""
    from qcache.rotation import hadamard_rotation

    for seed in (0, 1, 2):
        r = hadamard_rotation(64, seed)
        fold, block = native._hadamard_fold(r)
        assert block == 64 and torch.equal(fold, r[0])
        del r
    assert native._hadamard_fold(torch.linalg.qr(torch.randn(64, 64))[0]) is None
