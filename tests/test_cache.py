"""QuantCache on tiny random Llama / Qwen3 / Mistral / Gemma 3 models: every way generate uses a cache."""

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from conftest import make_model
from qcache import layout
from qcache.presets import recipe
from qcache import QuantCache, QuantCacheConfig
from qcache.handover import HeldStates
from qcache.cache import BlockLayer, QuantLayer, TokenWindowLayer
from qcache.tools.footprint import reachable_bytes
from qcache.rope import RopeHelper

# small blocks so that short prompts exercise sinks, quantized blocks and the residual
OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2)
# for checks of exact values and byte formulas: no rotation, uniform levels, the residual window as given (the
# defaults rotate values, put 2-bit keys on Lloyd-Max levels and hold the window 8-bit: tests/test_rotation.py,
# tests/test_levels.py, tests/test_window.py)
EXACT = dict(OPTS, rotation="none", rotate="kv", levels="uniform", window_bits=16)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# max |logit error| of the 8-bit cache, as a fraction of the logits' std (bf16 adds its own rounding)
TOL_8BIT = {torch.float32: 0.05, torch.bfloat16: 0.1, torch.float16: 0.1}


def prompt(n, batch=1, seed=1):
    return torch.randint(2, 96, (batch, n), generator=torch.Generator().manual_seed(seed))


def logits(model, ids, cache, **kw):
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True, **kw).logits.float()


def read_logits(model, ids, cache, first=None):
    """Logits of `ids` fed in two forwards, the first `first` tokens (a third by default) and then the rest, so
    that the rest reads what the cache holds: a forward into an empty cache attends to the states it computed."""
    first = ids.shape[1] // 3 if first is None else first
    return torch.cat([logits(model, ids[:, :first], cache), logits(model, ids[:, first:], cache)], dim=1)


def assert_greedy_agrees(model, seq, prompt_len, tol=0.05):
    """Each greedy token chosen through the cache is DynamicCache's argmax on the same prefix, except where
    DynamicCache's top-2 margin is within `tol` x logits std (a near tie that the 8-bit error may flip)."""
    ref = logits(model, seq, DynamicCache(config=model.config))[0, prompt_len - 1:-1]  # [new, vocab]
    chosen = seq[0, prompt_len:]
    top2 = ref.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) <= tol * ref.std()
    agree = ref.argmax(-1) == chosen
    assert bool((agree | near_tie).all()), (agree, near_tie)
    assert agree.float().mean() > 0.7


def generate(model, ids, cache, **kw):
    kw.setdefault("max_new_tokens", 12)
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, cache=cache, pad_token_id=0, **kw)


def test_users_example_as_written():
    """`model.generate(..., past_key_values=QuantCache(bits=4))`: no config given, the cache finds it."""
    model = make_model("llama")
    cache = QuantCache(bits=4)
    with torch.no_grad(), pytest.warns(FutureWarning):  # transformers renamed the argument to `cache`
        out = model.generate(prompt(300), past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 305)
    assert cache.memory().packed > 0 and len(cache.layers) == 2  # 300 tokens: past the first key block (260)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_8bit_forward_near_lossless(family, dtype):
    model = make_model(family, dtype)
    ids = prompt(150)
    ref = logits(model, ids, DynamicCache(config=model.config))
    cache = QuantCache(bits=8, **OPTS)
    out = read_logits(model, ids, cache)
    assert cache.memory().packed > 0  # the quantized path was taken
    assert (out - ref).abs().max() > 0  # and read: 8 bits are close, not exact
    assert (out - ref).abs().max() <= TOL_8BIT[dtype] * ref.std()


def test_error_grows_as_bits_shrink(family):
    model = make_model(family)
    ids = prompt(150)
    ref = logits(model, ids, DynamicCache(config=model.config))
    errs = [float((read_logits(model, ids, QuantCache(bits=b, **OPTS)) - ref).pow(2).mean()) for b in (8, 4, 3, 2)]
    assert errs == sorted(errs) and errs[0] < errs[-1] / 100, errs


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_greedy_8bit_matches_dynamic(family, dtype):
    model = make_model(family, dtype)
    ids = prompt(60)
    cache = QuantCache(bits=8, **OPTS)
    out = generate(model, ids, cache, max_new_tokens=20)
    assert_greedy_agrees(model, out, 60, TOL_8BIT[dtype])
    assert cache.get_seq_length() == out.shape[1] - 1  # the last token is never fed back


@pytest.mark.parametrize("bits", [4, 2])
def test_sampling(family, bits):
    model = make_model(family)
    cache = QuantCache(bits=bits, **OPTS)
    torch.manual_seed(0)
    out = generate(model, prompt(40), cache, do_sample=True, top_k=20, temperature=0.9, max_new_tokens=30)
    assert out.shape == (1, 70)
    assert cache.get_seq_length() == 69
    assert cache.memory().packed > 0


def test_beam_search_8bit_matches_dynamic(family):
    model = make_model(family)
    ids = prompt(50)
    out = generate(model, ids, QuantCache(bits=8, **EXACT), num_beams=3, max_new_tokens=16)
    ref = generate(model, ids, DynamicCache(config=model.config), num_beams=3, max_new_tokens=16)
    if torch.equal(out, ref):
        return
    # beams near a tie may part late: then the first half agrees, and the full-precision model scores our beam
    # as it scores its own (log-probability of the 16 new tokens)
    assert torch.equal(out[:, :58], ref[:, :58])
    score = lambda seq: float(logits(model, seq, DynamicCache(config=model.config))[0, 49:-1].log_softmax(-1)  # noqa: E731
                              .gather(-1, seq[0, 50:, None]).sum())
    assert abs(score(out) - score(ref)) < 0.5, (score(out), score(ref))


def test_beam_reorder_moves_codes_without_requantizing():
    model = make_model("llama")
    cache = QuantCache(bits=4, **OPTS)
    logits(model, prompt(60, batch=3), cache)
    store = cache.layers[0].store
    before = {name: t.clone() for name, t in store.views().items()}
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    assert store.length("token") > 0
    for name, t in before.items():  # every stored tensor, codes and scales included, moved row by row
        assert torch.equal(store.view(name), t[beam_idx]), name


@pytest.mark.parametrize("bits,tol", [(8, 0.05), (4, 0.5)])
def test_left_padded_batch_rows_match_alone(family, bits, tol):
    model = make_model(family)
    lengths = [70, 45, 58]
    rows = [prompt(n, seed=i)[0] for i, n in enumerate(lengths)]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, cache=QuantCache(bits=bits, **OPTS),
                               max_new_tokens=1, do_sample=False, pad_token_id=0, output_logits=True,
                               return_dict_in_generate=True).logits[0]
        for i, r in enumerate(rows):
            alone = model(r[None], cache=QuantCache(bits=bits, **OPTS), use_cache=True).logits[0, -1]
            ref = model(r[None], use_cache=False).logits[0, -1]
            assert (batch[i] - alone).abs().max() <= tol * ref.std(), (i, float((batch[i] - alone).abs().max()))


def test_padding_never_enters_key_statistics():
    model = make_model("llama")
    rope = RopeHelper(model.config)
    cfg = recipe(bits=4, k_group_size=16, v_group_size=16, v_scale="minmax", sink_tokens=0, recent_tokens=0)
    k = torch.randn(2, 2, 32, 32)
    v = torch.randn(2, 2, 32, 32)
    pos = torch.arange(32).expand(2, 32).clone()
    k_pad, pos_pad = k.clone(), pos.clone()
    k_pad[1, :, :5] = 1e3  # row 1: five pad tokens with huge keys, positions 0 like transformers gives them
    pos_pad[1, :5] = 0
    pos_pad[1, 5:] = torch.arange(27)
    padded, clean = BlockLayer(cfg, 0, rope), BlockLayer(cfg, 0, rope)
    padded.update(k_pad, v, kwargs={"position_ids": pos_pad})
    clean.update(k, v, kwargs={"position_ids": pos})
    assert padded.first.tolist() == [0, -5]  # row 1 starts 5 positions before 0: its first five tokens are padding
    k_scale = padded.store.view("k_scale")
    assert k_scale[1].abs().max() < 1.0  # a pad in the statistics would give scales ~ 1e3 / 15
    assert torch.equal(k_scale[0], clean.store.view("k_scale")[0])


def test_continue_conversation_on_same_cache(family):
    model = make_model(family)
    cache = QuantCache(bits=8, **OPTS)
    first = generate(model, prompt(40), cache, max_new_tokens=10)
    follow_up = torch.cat([first, prompt(15, seed=7)], dim=1)
    second = generate(model, follow_up, cache, max_new_tokens=10)
    assert torch.equal(second[:, :follow_up.shape[1]], follow_up)
    assert_greedy_agrees(model, second, follow_up.shape[1])
    assert cache.get_seq_length() == second.shape[1] - 1


@pytest.mark.parametrize("remove", [3, 20, 60])
def test_crop(remove):
    """Crop into the residual, through a quantized block and into the sinks; the cache keeps working."""
    model = make_model("llama")
    ids = prompt(62)
    cache = QuantCache(bits=8, **OPTS)
    logits(model, ids, cache)
    cache.crop(-remove)
    kept = 62 - remove
    assert cache.get_seq_length() == kept
    layer = cache.layers[0]
    assert layer.quantized_length % OPTS["k_group_size"] == 0  # only whole key blocks stay quantized
    assert layer.store.length("block") * OPTS["k_group_size"] == layer.quantized_length
    nxt = ids[:, kept:kept + 1]
    out = logits(model, nxt, cache)
    ref = logits(model, ids[:, :kept + 1], DynamicCache(config=model.config))[:, -1:]
    assert (out - ref).abs().max() <= 0.05 * ref.std()
    assert cache.get_seq_length() == kept + 1
    with pytest.raises(ValueError, match="negative"):
        cache.crop(5)


def test_reset_then_reuse_is_exact(family):
    model = make_model(family)
    ids = prompt(50)
    cache = QuantCache(bits=4, **OPTS)
    first = logits(model, ids, cache)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert torch.equal(logits(model, ids, cache), first)


def test_update_returns_what_is_stored_and_never_requantizes():
    model = make_model("llama")
    cache = QuantCache(bits=4, **EXACT)
    ids = prompt(80)
    logits(model, ids[:, :50], cache)
    layer = cache.layers[1]
    before = {name: t.clone() for name, t in layer.store.views(axis="token").items()}
    before |= {name: t.clone() for name, t in layer.store.views(axis="block").items()}
    n = layer.store.length("sink") + layer.quantized_length
    keys_before = layer.read()[0][:, :, :n]
    logits(model, ids[:, 50:], cache)  # more tokens: new blocks are appended, old ones untouched
    assert layer.quantized_length > n - layer.store.length("sink")
    for name, t in before.items():
        assert torch.equal(layer.store.view(name)[:, :, :t.shape[2]], t), name
    # what attention got back for the old tokens is exactly what the cache still holds
    new_k = torch.randn(1, 2, 1, 32)
    keys, _ = layer.update(new_k, torch.randn(1, 2, 1, 32), kwargs={"position_ids": torch.tensor([[80]])})
    torch.testing.assert_close(keys[:, :, :keys_before.shape[2]], keys_before, rtol=0, atol=0)
    assert torch.equal(keys[:, :, -1:], new_k)


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_memory_counts_really_packed_storage(bits):
    model = make_model("llama")
    cache = QuantCache(bits=bits, **EXACT)
    logits(model, prompt(150), cache)
    mem = cache.memory()
    layer = cache.layers[0]
    tq = layer.quantized_length
    assert tq == (150 - 2 - 4) // 16 * 16
    heads, head_dim, layers = 2, 32, 2
    assert mem.packed == layers * heads * tq * head_dim * 2 * bits // 8  # K and V, bits/8 bytes per value
    assert mem.full_precision == layers * heads * (150 - tq) * head_dim * 2 * 4  # fp32 model
    assert mem.tokens == 150
    expected = layout.bytes_per_token(recipe(bits=bits, **EXACT, scale_dtype="float16"),
        layers, heads, head_dim, 150, fp_bytes=4) * 150
    assert mem.total - mem.reserved - mem.rope == pytest.approx(expected)
    assert mem.total == reachable_bytes(cache)


def test_quantized_sliding_layers():
    model = make_model("gemma3")
    ids = prompt(100)  # longer than the window of 24
    cache = QuantCache(bits=8, sliding_layers="quantized", **OPTS)
    out = generate(model, ids, cache, max_new_tokens=30)
    assert_greedy_agrees(model, out, 100)
    sliding = cache.layers[0]
    assert isinstance(sliding, QuantLayer) and sliding.is_sliding
    assert sliding.stored_length() < 24 + OPTS["k_group_size"]  # bounded by the window, not the context
    native = QuantCache(bits=8, **OPTS)
    generate(model, ids, native, max_new_tokens=30)
    assert not isinstance(native.layers[0], QuantLayer)


def test_sliding_bits_sets_the_width_of_quantized_sliding_layers():
    model = make_model("gemma3")  # layers: sliding, full, sliding
    ids = prompt(100)
    cache = QuantCache(bits=2, sliding_layers="quantized", sliding_bits=8, **OPTS)
    generate(model, ids, cache, max_new_tokens=10)
    widths = [(layer.cfg.k_bits, layer.cfg.v_bits) for layer in cache.layers]
    assert widths == [(8, 8), (2, 2), (8, 8)]
    # the 8-bit sliding layer holds four times the code bytes of the 2-bit one
    two = QuantCache(bits=2, sliding_layers="quantized", **OPTS)
    generate(model, ids, two, max_new_tokens=10)
    assert [layer.cfg.k_bits for layer in two.layers] == [2, 2, 2]
    assert cache.layers[0].memory().packed > two.layers[0].memory().packed


def test_8bit_sliding_layers_hold_their_window_as_8bit_tokens():
    """At 8 bits a quantized sliding layer keeps no key blocks: exactly its window, 8-bit per token and head, trimmed
    token by token, and half the bytes of transformers' 16-bit window; the model's greedy tokens are kept."""
    model = make_model("gemma3")  # layers: sliding (window 24), full, sliding
    ids = prompt(100)
    cache = QuantCache(bits=4, sliding_layers="quantized", sliding_bits=8, **OPTS)
    out = generate(model, ids, cache, max_new_tokens=20)
    assert_greedy_agrees(model, out, 100)
    sliding, full = cache.layers[0], cache.layers[1]
    assert isinstance(sliding, TokenWindowLayer) and isinstance(full, BlockLayer)
    assert sliding.quantized_length == 0 and sliding.store.length("residual") == 23  # window - 1, token by token
    assert full.quantized_length > 0  # the full layer keeps its blocks
    mem = sliding.memory()
    D, H = model.config.head_dim, model.config.num_key_value_heads
    held = mem.total - mem.reserved - mem.rope - mem.rotation - mem.codebooks
    per_token = 2 * H * (D + 2 * 2)  # K and V: 8-bit codes + a float16 scale and zero per token and head
    assert held == pytest.approx(23 * per_token, abs=64)  # + the int64 first position per row
    ref = DynamicCache(config=model.config)
    logits(model, out[:, :-1], ref)
    assert held < 0.6 * ref.layers[0].keys[:, :, -23:].numel() * 2 * 4  # fp32 model: 4 bytes per value, K and V
    # fed in chunks shorter than the window: after each chunk it holds min(seen, window - 1) tokens
    chunked, seen = QuantCache(bits=4, sliding_layers="quantized", sliding_bits=8, **OPTS), 0
    for chunk in ids.split(7, dim=1):
        logits(model, chunk, chunked)
        seen += chunk.shape[1]
        assert chunked.layers[0].store.length("residual") == min(seen, 23)


def _window_error(layer, ref_layer, n):
    """Relative RMS error of a sliding layer's held keys and values against DynamicCache's last `n` tokens."""
    keys, values = layer._window()
    return [((ours.float() - theirs[:, :, -n:].float()).norm() / theirs[:, :, -n:].float().norm()).item()
            for ours, theirs in ((keys, ref_layer.keys), (values, ref_layer.values))]


@pytest.mark.parametrize("bits", [2, 4])
def test_token_sliding_layers_hold_their_window_as_rotated_tokens(bits):
    """sliding_layers="tokens": a sliding layer holds exactly its window, each token quantized on its own (rotated,
    one scale per token and head, Gaussian levels), at the bytes that form costs; its first layer's keys and values
    (inputs the same as DynamicCache's) come back within the error of their width, less at 4 bits than at 2."""
    model = make_model("gemma3")  # layers: sliding (window 24), full, sliding
    ids = prompt(100)
    cache, ref = QuantCache(bits=4, sliding_layers="tokens", sliding_bits=bits, **OPTS), DynamicCache(config=model.config)
    logits(model, ids, cache), logits(model, ids, ref)
    sliding, full = cache.layers[0], cache.layers[1]
    assert isinstance(sliding, TokenWindowLayer) and isinstance(full, BlockLayer) and full.cfg.k_bits == 4
    assert sliding.quantized_length == 0 and sliding.store.length("residual") == 23
    assert [c.norm and c.bits for c in sliding.window_codecs] == [bits, bits]
    mem = sliding.memory()
    D, H = model.config.head_dim, model.config.num_key_value_heads
    held = mem.total - mem.reserved - mem.rope - mem.rotation - mem.codebooks
    assert held == pytest.approx(23 * 2 * H * (D * bits / 8 + 2), abs=64)  # codes + one float16 scale, K and V
    k_err, v_err = _window_error(sliding, ref.layers[0], 23)
    limit = {2: 0.45, 4: 0.13}[bits]  # Gaussian Lloyd-Max RMS error: 0.34 at 2 bits, 0.097 at 4
    assert 0.5 * limit < k_err < limit and 0.5 * limit < v_err < limit, (k_err, v_err)
    again = QuantCache(bits=4, sliding_layers="tokens", sliding_bits=bits, **OPTS)
    out = generate(model, ids, again, max_new_tokens=6)  # decoding goes on, token by token
    assert out.shape[1] == 106 and again.layers[0].store.length("residual") == 23


def test_token_sliding_layers_without_rotation_use_minmax_groups():
    model = make_model("gemma3")
    cache = QuantCache(bits=4, sliding_layers="tokens", rotation="none", rotate="kv", **OPTS)
    logits(model, prompt(60), cache)
    layer = cache.layers[0]
    assert [(c.norm, c.rotation, c.group) for c in layer.window_codecs] == [(False, False, 16)] * 2
    mem = layer.memory()
    D, H = model.config.head_dim, model.config.num_key_value_heads
    held = mem.total - mem.reserved - mem.rope - mem.rotation - mem.codebooks
    assert held == pytest.approx(23 * 2 * H * (D * 4 / 8 + D // 16 * 2 * 2), abs=64)  # a scale and a zero per group


def test_sliding_v_bits_sets_the_value_width_of_sliding_layers():
    model = make_model("gemma3")
    cache = QuantCache(bits=2, sliding_layers="tokens", sliding_bits=8, sliding_v_bits=4, **OPTS)
    logits(model, prompt(60), cache)
    layer = cache.layers[0]
    assert [(c.bits, c.norm) for c in layer.window_codecs] == [(8, False), (4, True)]
    assert (layer.cfg.k_bits, layer.cfg.v_bits, cache.layers[1].cfg.k_bits) == (8, 4, 2)
    mem = layer.memory()
    D, H = model.config.head_dim, model.config.num_key_value_heads
    held = mem.total - mem.reserved - mem.rope - mem.rotation - mem.codebooks
    assert held == pytest.approx(23 * H * ((D + 4) + (D // 2 + 2)), abs=64)  # 8-bit keys + scale/zero, 4-bit values


@pytest.mark.parametrize("kwargs,match", [
    ({"sliding_v_bits": 4, "sliding_layers": "tokens"}, r"sliding_v_bits=4.*sliding_bits, which is None"),
    ({"sliding_v_bits": 5, "sliding_bits": 4, "sliding_layers": "tokens"}, r"sliding_v_bits=5.*\[2, 3, 4, 8\]"),
    ({"sliding_bits": 8}, r"sliding_bits=8.*sliding_layers='native'.*allowed: sliding_layers='quantized'"),
    ({"sliding_layers": "window"}, r"sliding_layers='window'.*\['native', 'quantized', 'tokens'\]"),
    ({"sliding_bits": 5, "sliding_layers": "quantized"}, r"sliding_bits=5.*\[2, 3, 4, 8\]"),
    ({"sliding_bits": 8, "sliding_layers": "quantized", "layer_bits": [(4, 4)] * 3}, "sliding_bits=8 and layer_bits"),
])
def test_bad_sliding_bits_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantCacheConfig(**kwargs)


# --- bad input -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 5}, r"bits=5.*\[2, 3, 4, 8\]"),
    ({"k_bits": 1}, r"k_bits=1.*\[2, 3, 4, 8\]"),
    ({"v_bits": 16}, r"v_bits=16.*\[2, 3, 4, 8\]"),
    ({"k_group_size": 0}, "k_group_size=0"),
    ({"v_group_size": 12}, "v_group_size=12"),
    ({"sliding_layers": "fp8"}, r"sliding_layers='fp8'.*native"),
    ({"rope": "none"}, r"rope='none'.*pre"),
])
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantCache(**kwargs)


def test_group_size_that_does_not_fit_head_dim():
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"v_group_size=64 does not divide head_dim=32.*\[8, 16, 32\]"):
        logits(model, prompt(10), QuantCache(bits=4, v_group_size=64, v_scale="minmax"))


def test_model_without_rope_raises():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=96)).eval()
    with pytest.raises(ValueError, match="gpt2.*rope='post'"):
        QuantCache(model.config, bits=4)
    with pytest.raises(ValueError, match="gpt2.*rope='post'"):
        logits(model, prompt(10), QuantCache(bits=4))


def test_cache_reused_with_another_model_raises():
    llama, qwen = make_model("llama"), make_model("qwen3")
    cache = QuantCache(bits=4, **OPTS)
    logits(llama, prompt(30), cache)
    with pytest.raises(ValueError, match="another model.*model_type"):
        logits(qwen, prompt(5), cache)
    explicit = QuantCache(llama.config, bits=4, **OPTS)
    with pytest.raises(ValueError, match="another model"):
        logits(qwen, prompt(5), explicit)


def test_direct_update_without_config_names_the_fix():
    cache = QuantCache(bits=4)
    with pytest.raises(ValueError, match=r"QuantCache\(model.config"):
        cache.update(torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32), 0)


# --- what the cache holds --------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,kwargs", [
    ("llama", dict(bits=4)),
    ("llama", dict(bits=2, outliers=1)),
    ("llama", dict(k_bits=8, v_bits=3, kernel="compiled")),
    ("gemma3", dict(bits=4)),  # sliding layers native (transformers' own layers)
    ("gemma3", dict(bits=4, sliding_layers="quantized")),
])
def test_memory_total_is_every_reachable_byte(family, kwargs):
    """`memory().total` is what the cache really holds: every byte of every tensor reachable from it, RoPE helper,
    positions and preallocated capacity included (counted independently by qcache.tools.footprint)."""
    model = make_model(family)
    cache = QuantCache(**kwargs, **OPTS)
    generate(model, prompt(90), cache, max_new_tokens=20)
    mem = cache.memory()
    assert mem.packed > 0
    assert mem.total == reachable_bytes(cache)
    assert mem.reserved < 0.5 * mem.total


def test_crop_through_a_block_leaves_no_trace():
    """Assisted decoding's rollback: after a crop through a key block, the kept blocks' codes and scales are those
    of a cache that never saw the removed tokens, and the cut block's kept tokens hold the values they were read
    with (back in full precision)."""
    model = make_model("llama")
    ids = prompt(70)
    cache = QuantCache(bits=4, **EXACT)
    logits(model, ids, cache)
    layer = cache.layers[1]
    read_before = layer.read()[0]
    kept = 2 + 16 * 2 + 5  # sinks, two whole blocks, 5 tokens of the third block
    cache.crop(-(70 - kept))
    fresh = QuantCache(bits=4, **EXACT)
    logits(model, ids[:, :kept], fresh)
    for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale"):
        got, ref = layer.store.view(name), fresh.layers[1].store.view(name)
        assert got.shape[2] == min(ref.shape[2], got.shape[2]) and torch.equal(got, ref[:, :, :got.shape[2]]), name
    assert layer.quantized_length == 32 and layer.store.length("residual") == 5
    torch.testing.assert_close(layer.read()[0], read_before[:, :, :kept], rtol=0, atol=0)
    out = logits(model, ids[:, kept:kept + 20], cache)  # refills and re-quantizes the block
    ref = logits(model, ids[:, :kept + 20], DynamicCache(config=model.config))[:, kept:]
    assert (out - ref).abs().max() <= 0.5 * ref.std()


@pytest.mark.parametrize("positions,match", [
    ([[0, 1, 2, 1, 1]], "right padding"),  # generate's positions for a right-padded row
    ([[0, 1, 2, 0, 1]], "restart"),  # two packed sequences
    ([[0, 1, 2, 4, 5]], "gaps"),
])
def test_positions_that_are_not_one_run_per_row_raise(positions, match):
    layer = BlockLayer(recipe(bits=4, **OPTS), 0, RopeHelper(make_model("llama").config))
    with pytest.raises(ValueError, match=match):
        layer.update(torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32),
                     kwargs={"position_ids": torch.tensor(positions)})


def test_left_padding_then_continuation_is_one_run():
    layer = BlockLayer(recipe(bits=4, **OPTS), 0, RopeHelper(make_model("llama").config))
    pos = torch.tensor([[0, 1, 2, 3], [1, 1, 0, 1]])  # row 1: two pads (given 1, as generate gives them)
    layer.update(torch.randn(2, 2, 4, 32), torch.randn(2, 2, 4, 32), kwargs={"position_ids": pos})
    assert layer.first.tolist() == [0, -2]
    layer.update(torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32), kwargs={"position_ids": torch.tensor([[4], [2]])})
    with pytest.raises(ValueError, match="row 1"):
        layer.update(torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32),
                     kwargs={"position_ids": torch.tensor([[5], [5]])})


def test_decode_states_kept_past_their_step_keep_what_they_showed():
    """A decode step hands attention HeldStates that read the layer lazily; kept while the layer takes more tokens
    (or is cropped), they still hold that step's keys and values, and they no longer attend from the codes."""
    model = make_model("llama")
    cache = QuantCache(model.config, bits=4, kernel="compiled", **OPTS)
    logits(model, prompt(60), cache)
    layer = cache.layers[0]
    step = lambda p: layer.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32),  # noqa: E731
                                  kwargs={"position_ids": torch.tensor([[p]])})
    keys, values = step(60)
    assert isinstance(keys, HeldStates) and keys.shape[2] == layer.stored_length() == 61
    now_k, now_v = (t.clone() for t in layer.read())
    step(61)
    assert keys.shape[2] == 61 and torch.equal(keys.dense(), now_k) and torch.equal(values.dense(), now_v)
    assert not keys.step.live
    with pytest.raises(RuntimeError, match="attended after the layer took more tokens"):
        keys.step.attend(torch.randn(1, 2, 2, 32), None, None)
    keys, _ = step(62)
    now_k = layer.read()[0].clone()
    layer.crop(-3)
    assert torch.equal(keys.dense(), now_k) and layer.stored_length() == 60


def test_static_cache_settings_are_refused_with_a_quantcache():
    """A model whose generation config asks for a static cache: transformers refuses to combine it with a cache object
    (a clear ValueError), rather than silently running one or the other."""
    model = make_model("llama")
    model.generation_config.cache_implementation = "static"
    with pytest.raises(ValueError, match="cache_implementation.*cache"):
        generate(model, prompt(20), QuantCache(bits=4, **OPTS), max_new_tokens=2)


def test_native_sliding_layers_hold_their_window_only():
    """After a long prefill chunk, a native sliding layer holds its window, not the chunk (transformers' own layer
    keeps a view into the whole concatenation); its outputs are transformers' own."""
    model = make_model("gemma3")
    ids = prompt(200)  # window 24
    cache, ref = QuantCache(bits=4, **OPTS), DynamicCache(config=model.config)
    torch.testing.assert_close(logits(model, ids, cache), logits(model, ids, ref), rtol=0.5, atol=0.5)
    ours, theirs = cache.layers[0], ref.layers[0]
    assert torch.equal(ours.keys, theirs.keys) and ours.keys.shape[2] == 23
    assert ours.keys.untyped_storage().nbytes() == ours.keys.numel() * ours.keys.element_size()
    assert theirs.keys.untyped_storage().nbytes() > 8 * theirs.keys.numel() * theirs.keys.element_size()
    out = generate(model, ids, QuantCache(bits=8, **OPTS), max_new_tokens=10)
    assert_greedy_agrees(model, out, 200)
