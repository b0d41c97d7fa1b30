"""Families that need more than the common path, each checked against DynamicCache at 8 bits over 40 greedy tokens
(the coverage checks of qcache/check.py, on a tiny random model) with what makes it different made to matter."""

import pytest
import torch
from transformers import DynamicCache

from qcache import QuantCache
from qcache.check import CACHE_OPTIONS, LOGIT_TOLERANCE, SLIDING_THEN_FULL, Family, build_model, greedy, prompt_for

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
