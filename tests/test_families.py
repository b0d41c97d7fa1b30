"""Families that need more than the common path, each checked against DynamicCache at 8 bits over 40 greedy tokens
(the coverage checks of qcache/check.py, on a tiny random model) with what makes it different made to matter."""

import pytest
import torch
from transformers import DynamicCache

from qcache import QuantCache
from qcache.check import (
    CACHE_OPTIONS, LOGIT_TOLERANCE, SLIDING_THEN_FULL, Family, build_model, check_family, greedy, prompt_for,
)
from qcache.rope import RopeHelper

GPT_OSS = Family("gpt_oss", "GPT-OSS", "gpt_oss", dict(SLIDING_THEN_FULL))


def _gpt_oss(sinks: float):
    model = build_model(GPT_OSS)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(sinks)  # learned attention sinks, large enough to carry real weight
    return model


@pytest.mark.parametrize("kernel", ["eager", "compiled"])
def test_gpt_oss_matches_dynamic_cache_with_its_sinks(kernel):
    """gpt-oss hands cos/sin one per rotated pair (width D/2) and attends with learned sinks; at 8 bits the cache
    gives DynamicCache's 40 greedy tokens within the coverage tolerance, on the eager read and on the compiled one
    (whose decode steps hand attention the HeldStates, read by gpt-oss's eager attention with its sinks)."""
    model = _gpt_oss(3.0)
    prompt = prompt_for(model)
    ref_tokens, ref_logits = greedy(model, prompt, DynamicCache(config=model.config))
    cache = QuantCache(**CACHE_OPTIONS, kernel=kernel)
    tokens, logits = greedy(model, prompt, cache)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max() <= LOGIT_TOLERANCE * ref_logits.std()
    assert cache.layers[1].quantized_length > 0  # the full-attention layer holds key blocks
    # the sinks matter here: the same model without them lands far outside the tolerance
    _, no_sinks = greedy(_gpt_oss(-1e4), prompt, DynamicCache(config=model.config))
    assert (no_sinks - ref_logits).abs().max() > 10 * LOGIT_TOLERANCE * ref_logits.std()


def test_gpt_oss_half_width_rotation_is_the_rotate_half_layout():
    """The widened cos/sin rotate keys exactly as gpt-oss's own apply_rotary_pos_emb does."""
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    from qcache.rope import RopeHelper, apply_rope, undo_rope

    config = build_model(GPT_OSS).config
    rope = RopeHelper(config)
    pos = torch.arange(5, 12)[None]
    cos, sin = rope.cos_sin(pos, 0)
    assert cos.shape[-1] == config.head_dim
    x = torch.randn(1, 2, 7, config.head_dim)
    raw = rope._compute(pos, rope._layer_type(0), raw=True)
    assert raw[0].shape[-1] == config.head_dim // 2
    expected, _ = m.apply_rotary_pos_emb(x, x, *raw)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(undo_rope(expected, cos, sin), x, rtol=1e-5, atol=1e-5)


# interleaved RoPE pairs (2i, 2i+1): Cohere's rotary module repeats each pair's cos/sin pairwise, the others hand
# [t, t] and re-interleave it in apply_rotary_pos_emb; GLM and GLM-4 rotate half of each head
INTERLEAVED = {
    "cohere": Family("cohere", "Cohere", "cohere"),
    "cohere2": Family("cohere2", "Cohere2", "cohere2", dict(SLIDING_THEN_FULL)),
    "glm": Family("glm", "GLM", "glm"),
    "glm4": Family("glm4", "GLM-4", "glm4"),
    "helium": Family("helium", "Helium", "helium"),
    "ernie4_5": Family("ernie4_5", "ERNIE 4.5", "ernie4_5"),
}


def _matches(model, prompt, ref_tokens, ref_logits, cache) -> tuple[bool, float]:
    """(tokens equal, max |delta logit| / std) of `cache`'s greedy run against DynamicCache's."""
    tokens, logits = greedy(model, prompt, cache)
    return torch.equal(tokens, ref_tokens), float((logits - ref_logits).abs().max() / ref_logits.std())


# each family on the eager read; the compiled read and decode (a compile each, tens of seconds on a CPU) on the two
# distinct tables: Cohere's pairwise cos/sin, GLM's half-width rotation of half of each head
INTERLEAVED_RUNS = [(key, "eager") for key in sorted(INTERLEAVED)] + [("cohere", "compiled"), ("glm", "compiled")]


@pytest.mark.parametrize("key,kernel", INTERLEAVED_RUNS)
def test_interleaved_rope_families_match_dynamic_cache(key, kernel, monkeypatch):
    """Each family with interleaved pairs matches DynamicCache at 8 bits over 40 greedy tokens by the coverage rule
    (qcache/check.py: logits within the tolerance, tokens equal or parting at a near tie of DynamicCache's own),
    with keys quantized pre-RoPE in pair order."""
    monkeypatch.setenv("QCACHE_KERNEL", kernel)
    outcome, run = check_family(INTERLEAVED[key])
    assert outcome.kind == "match", outcome.detail
    assert outcome.quantized_tokens > 0
    model = run[0]
    rope = RopeHelper(model.config.get_text_config(decoder=True))
    assert rope.layout == "interleaved"


@pytest.mark.parametrize("order", ["pairs", "model order (control)"])
def test_interleaved_keys_are_quantized_before_rope(order, monkeypatch):
    """One key repeated at 300 positions, rotated by Cohere's own apply_rotary_pos_emb: pre-RoPE it is the same
    vector at every position, so each channel's block range is a point and even 2-bit keys read back exact. The
    control keeps the model's channel order (the rotate-half arithmetic on interleaved channels: not pre-RoPE), where
    the same keys spread over their ranges and come back far off."""
    from transformers.models.cohere import modeling_cohere

    from qcache.layers import QuantLayer

    if order != "pairs":
        monkeypatch.setattr(QuantLayer, "_key_order", lambda self, x: x)
        monkeypatch.setattr(QuantLayer, "_model_order", lambda self, x: x)
    config = build_model(INTERLEAVED["cohere"]).config
    rope = RopeHelper(config)
    D, T = rope.head_dim, 300
    pos = torch.arange(T)[None]
    k0 = torch.randn(1, config.num_key_value_heads, 1, D, generator=torch.Generator().manual_seed(3)).expand(-1, -1, T, -1)
    keys, _ = modeling_cohere.apply_rotary_pos_emb(k0, k0, *rope._compute(pos, None, raw=True))
    cache = QuantCache(config, bits=2, rotate="v", sink_tokens=0, recent_tokens=16, k_group_size=32, window_bits=16,
                       kernel="eager")
    cache.update(keys, torch.randn_like(keys), 0, kwargs={"position_ids": pos})
    read, _ = cache.layers[0].read()
    assert cache.layers[0].quantized_length == 256
    err = float((read - keys).abs().max() / keys.abs().max())
    assert err < 1e-2 if order == "pairs" else err > 0.1


# attention that hands the cache no position_ids: the tokens' places in the cache stand in for them
NO_POSITION_IDS = {
    "stablelm": Family("stablelm", "StableLM", "stablelm"),
    "gpt_neox": Family("gpt_neox", "GPT-NeoX", "gpt_neox"),
    "persimmon": Family("persimmon", "Persimmon", "persimmon"),
    "falcon": Family("falcon", "Falcon", "falcon", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "ministral3": Family("ministral3", "Ministral 3", "ministral3"),
}


# GPT-NeoX (a quarter of each head rotary) and Ministral 3 (YaRN: a scaling folded into cos/sin) on the compiled
# kernel, whose decode steps attend from the codes at positions taken from the cache's places; the others on the
# eager read (a compile costs tens of seconds on a CPU)
NO_POSITION_IDS_COMPILED = {"gpt_neox", "ministral3"}


@pytest.mark.parametrize("key", sorted(NO_POSITION_IDS))
def test_families_without_position_ids_match_dynamic_cache(key, monkeypatch):
    """Each family whose attention calls `Cache.update` without position_ids matches DynamicCache at 8 bits over 40
    greedy tokens (the coverage rule)."""
    monkeypatch.setenv("QCACHE_KERNEL", "compiled" if key in NO_POSITION_IDS_COMPILED else "eager")
    outcome, _ = check_family(NO_POSITION_IDS[key])
    assert outcome.kind == "match", outcome.detail
    assert outcome.quantized_tokens > 0


def test_a_left_padded_batch_without_position_ids_matches_dynamic_cache():
    """GPT-NeoX with two prompts, one left-padded by 7 tokens: the model's positions of that row are the cache's
    places less 7, a constant per row, so its stored keys stay position-free and the batch matches DynamicCache."""
    model = build_model(NO_POSITION_IDS["gpt_neox"])
    prompt = prompt_for(model)
    ids = torch.cat([prompt, torch.cat([torch.zeros(1, 7, dtype=torch.long), prompt[:, 7:]], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    runs = []
    for cache in (DynamicCache(config=model.config), QuantCache(**CACHE_OPTIONS, kernel="eager")):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=24, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        runs.append((out.sequences, torch.stack(out.logits).float()))
    (ref_tokens, ref_logits), (tokens, logits) = runs
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max() <= LOGIT_TOLERANCE * ref_logits.std()


# MiMo-V2-Flash: keys 32 wide (a third of them rotary), values 64; its sliding layers compute twice the config's kv
# heads and attend with learned sinks; a window small enough to slide within the prompt
MIMO = Family("mimo_v2_flash", "MiMo-V2-Flash", "mimo_v2_flash",
              dict(SLIDING_THEN_FULL, head_dim=32, v_head_dim=64, sliding_window=24))


def _mimo(sinks: float = 3.0):
    model = build_model(MIMO)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.fill_(sinks)
    return model


@pytest.mark.parametrize("kernel, sliding", [("eager", "native"), ("compiled", "native"), ("eager", "quantized")])
def test_mimo_v2_flash_values_wider_than_keys_match_dynamic_cache(kernel, sliding):
    """Keys of head_dim 32 and values of 64 are held each at its own width; at 8 bits the cache gives DynamicCache's
    40 greedy tokens within the coverage tolerance, its sliding layers (twice the config's kv heads, with sinks)
    native or quantized."""
    model = _mimo()
    config = model.config
    assert (config.head_dim, config.v_head_dim) == (32, 64)
    prompt = prompt_for(model)
    ref_tokens, ref_logits = greedy(model, prompt, DynamicCache(config=config))
    cache = QuantCache(**CACHE_OPTIONS, kernel=kernel, sliding_layers=sliding)
    tokens, logits = greedy(model, prompt, cache)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max() <= LOGIT_TOLERANCE * ref_logits.std()
    full = cache.layers[1]
    assert full.quantized_length > 0 and (full.head_dim, full.v_head_dim) == (32, 64)
    assert {name: full.store.parts[name].shape for name in ("k_codes", "v_codes", "sink_k", "sink_v")} == {
        "k_codes": (32,), "v_codes": (64,), "sink_k": (32,), "sink_v": (64,)}
    if sliding == "quantized":
        assert cache.layers[0].store.heads == 2 * config.num_key_value_heads


def test_mimo_v2_flash_default_recipe_rotates_each_width_and_round_trips(tmp_path):
    """The defaults (rotated values and window keys, norm values) on keys and values of different widths: each
    stream takes the rotation of its own width; save -> load -> continue equals continue, bit for bit, and a fork
    continues as the original does."""
    from test_persist import ids, run

    model = _mimo()
    cache = QuantCache(model.config, bits=4, k_group_size=16, recent_tokens=4, sink_tokens=2, kernel="eager")
    with torch.no_grad():
        model(ids(70, 1), past_key_values=cache, use_cache=True)
    full = cache.layers[1]
    assert full.quantized_length > 0
    assert full.consts["v"]["rotation"].shape == (64, 64)
    assert full.window_consts[0]["rotation"].shape == (32, 32)
    assert full.store.parts["wk_codes"].shape == (32,) and full.store.parts["wv_codes"].shape == (64,)
    path = cache.save(tmp_path / "mimo.safetensors")
    loaded, forked = QuantCache.load(path, model), cache.fork()
    more = ids(20, 2)  # crosses a key block flush
    ref = run(model, cache, more, 70)
    assert torch.equal(run(model, loaded, more, 70), ref)
    assert torch.equal(run(model, forked, more, 70), ref)


def test_latent_attention_is_refused_naming_what_it_caches():
    """DeepSeek-V3 hands the cache its latent and rotary part (widths the config does not give keys and values):
    refused with that reason before anything is stored."""
    model = build_model(Family("deepseek_v3", "DeepSeek-V3", "deepseek_v3",
                               dict(kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                    v_head_dim=16, first_k_dense_replace=2)))
    with pytest.raises(ValueError, match=r"latent and rotary part.*keys and values of the config's head_dim"):
        greedy(model, prompt_for(model), QuantCache(**CACHE_OPTIONS), steps=2)
