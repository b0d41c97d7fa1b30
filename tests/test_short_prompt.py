"""A prompt shorter than what a layer needs to quantize its first key block is held as given ("early"), so a short
chat through `QuantCache(bits=4)` answers exactly as the default cache does; once a block is due, those tokens
take the 8-bit codes they would have had from the start."""

import pytest
import torch
from transformers import DynamicCache

from qcache import QuantCache
from qcache.check import SMOKE_FAMILIES, build_model, greedy
from qcache.layers import QuantLayer

FAMILIES = {f.key: f for f in SMOKE_FAMILIES if f.key in ("llama", "qwen2", "qwen3", "gemma3_text")}
PROMPT = 40


def _model(key: str, bias_scale: float = 0.0):
    model = build_model(FAMILIES[key])
    if bias_scale:  # Qwen2's k_proj bias made a few huge outlier channels, as in real Qwen2.5 checkpoints
        with torch.no_grad():
            for layer in model.model.layers:
                b = layer.self_attn.k_proj.bias
                b.zero_()
                b[::7] = bias_scale * torch.linspace(1, 2, b[::7].numel())
    return model


def _prompt(model) -> torch.Tensor:
    vocab = model.get_output_embeddings().weight.shape[0]
    return torch.randint(3, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("key, bias_scale", [("llama", 0.0), ("qwen2", 0.0), ("qwen2", 30.0), ("qwen3", 0.0),
                                             ("gemma3_text", 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_short_chat_answers_as_the_default_cache(key, bias_scale, dtype):
    """40 prompt tokens and 40 greedy ones stay below sinks + recent + one block (4 + 128 + 128 at bits=4): every
    token is held as given, so tokens and logits are DynamicCache's, bit for bit."""
    model = _model(key, bias_scale).to(dtype)
    prompt = _prompt(model)
    ref_tokens, ref_logits = greedy(model, prompt, DynamicCache(config=model.config))
    cache = QuantCache(bits=4)
    tokens, logits = greedy(model, prompt, cache)
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)
    held = [layer for layer in cache.layers if hasattr(layer, "store") and layer.store.names("early")]
    assert held and all(layer.store.length("early") > 0 for layer in held)
    assert all(layer.quantized_length == 0 and layer.store.length("residual") == 0 for layer in held)


def test_outlier_channels_would_change_the_answer_in_an_8bit_window(monkeypatch):
    """What the early tokens are for: with every residual token coded to 8 bits on arrival (the layer as it was
    before them), the same short chat leaves DynamicCache's logits on the outlier-channel model (by ~1 % of their
    spread on this tiny random model, whose greedy tokens do not flip; Qwen2.5-Coder-1.5B's answer changed)."""
    model = _model("qwen2", 30.0)
    prompt = _prompt(model)
    _, ref_logits = greedy(model, prompt, DynamicCache(config=model.config), steps=16)
    _, exact = greedy(model, prompt, QuantCache(bits=4), steps=16)
    monkeypatch.setattr(QuantLayer, "_append_window", lambda self, k, v: self._code_window(k, v))
    _, coded = greedy(model, prompt, QuantCache(bits=4), steps=16)
    assert torch.equal(exact, ref_logits)
    assert float((coded - ref_logits).abs().max()) > 0.005 * float(ref_logits.std())


@pytest.mark.parametrize("window_bits", [8, 16])
def test_token_by_token_reaches_the_codes_of_one_prefill(window_bits):
    """Tokens fed one at a time past the first block end in the codes (quantized region and coded residual) that
    one prefill of the same tokens gives, so long-context numbers do not move."""
    model = _model("llama")
    opts = dict(bits=4, window_bits=window_bits, sink_tokens=2, recent_tokens=8, k_group_size=16, v_group_size=16,
                v_scale="minmax", rotate="v")
    g = torch.Generator().manual_seed(0)
    n = 2 + 8 + 16 + 11  # one block quantized, 8 + 11 in the residual
    k, v = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    one = QuantCache(model.config, **opts)
    one.update(k, v, 0, kwargs={"position_ids": torch.arange(n)[None]})
    steps = QuantCache(model.config, **opts)
    early_seen = 0
    for t in range(n):
        steps.update(k[:, :, t:t + 1], v[:, :, t:t + 1], 0, kwargs={"position_ids": torch.tensor([[t]])})
        early_seen = max(early_seen, steps.layers[0].store.length("early"))
    a, b = one.layers[0].store, steps.layers[0].store
    assert early_seen == (2 + 8 + 16 - 1 - 2 if window_bits == 8 else 0)
    assert b.length("early") == 0 and b.length("token") == 16
    for name in a.parts:
        assert a.length(a.parts[name].axis) == b.length(b.parts[name].axis), name
        assert torch.equal(a.view(name), b.view(name)), name


def test_crop_removes_early_tokens_first():
    model = _model("llama")
    cache = QuantCache(model.config, bits=4)
    k, v = torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    cache.update(k, v, 0, kwargs={"position_ids": torch.arange(30)[None]})
    layer = cache.layers[0]
    assert layer.store.length("early") == 26 and layer.store.length("sink") == 4
    layer.crop(-10)
    assert layer.store.length("early") == 16 and layer.get_seq_length() == 20
    keys, values = layer.read()
    assert torch.equal(keys, k[:, :, :20]) and torch.equal(values, v[:, :, :20])
    layer.crop(-18)
    assert layer.store.length("early") == 0 and layer.store.length("sink") == 2
