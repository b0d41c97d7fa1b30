"""How `QuantCache(bits=4)` finds its model without being given a config, under the wrappers users put around
models: torch.compile, accelerate hooks, gradient-checkpointing layers; and what happens where it cannot."""

import pytest
import torch

from conftest import make_model
from qcache import QuantCache

OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2)


def prompt(n=60, seed=1):
    return torch.randint(2, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def greedy(model, cache, n=8):
    with torch.no_grad():
        return model.generate(prompt(), cache=cache, max_new_tokens=n, do_sample=False, pad_token_id=0)


def test_torch_compiled_model_binds_and_decodes_the_same():
    """torch.compile(model): dynamo traces the model and breaks the graph where the cache looks up its caller; the
    cache binds, and the tokens equal the uncompiled model's through the same kind of cache."""
    model = make_model("llama")
    ref = greedy(model, QuantCache(bits=8, **OPTS))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")  # dynamo's tracing (graph breaks), without a C++ build
    cache = QuantCache(bits=8, **OPTS)
    out = greedy(compiled, cache)
    assert torch.equal(out, ref)
    assert cache.layers and cache.layers[0].quantized_length > 0


def test_accelerate_hooks_between_module_and_cache():
    """accelerate's hooks (as device_map / offloading attach them) wrap module forwards: cpu_offload on the weights,
    and a device-alignment hook on every attention module itself, so frames of accelerate sit between the attention
    module and Cache.update's caller. The module is still found, and the result equals the unhooked model's."""
    from accelerate import cpu_offload
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model = make_model("llama")
    ref = greedy(model, QuantCache(bits=8, **OPTS))
    hooked = cpu_offload(make_model("llama"), execution_device="cpu")
    for layer in hooked.model.layers:
        add_hook_to_module(layer.self_attn, AlignDevicesHook(execution_device="cpu"), append=True)
    assert hasattr(hooked.model.layers[0].self_attn, "_hf_hook")
    assert torch.equal(greedy(hooked, QuantCache(bits=8, **OPTS)), ref)


def test_gradient_checkpointing_layers():
    model = make_model("llama")
    ref = greedy(model, QuantCache(bits=8, **OPTS))
    model.gradient_checkpointing_enable()
    assert model.model.layers[0].gradient_checkpointing
    assert torch.equal(greedy(model, QuantCache(bits=8, **OPTS)), ref)


def test_attention_without_a_module_needs_the_config():
    """Attention written as a free function (no module on the call stack): QuantCache(bits=4) cannot know the RoPE
    to undo and says how to give it; QuantCache(model.config) works."""
    model = make_model("llama")

    def attention_as_a_function(cache, k, v):
        return cache.update(k, v, 0, kwargs={"position_ids": torch.arange(5)[None]})

    k = torch.randn(1, 2, 5, 32)
    with pytest.raises(ValueError, match=r"QuantCache\(model.config"):
        attention_as_a_function(QuantCache(bits=4), k, k)
    keys, _ = attention_as_a_function(QuantCache(model.config, bits=4, window_bits=16), k, k)
    assert torch.equal(keys, k)  # 5 tokens: all in the full-precision sinks and residual


def test_a_cache_bound_to_one_model_refuses_another_geometry_on_any_layer():
    llama = make_model("llama")
    cache = QuantCache(llama.config, bits=4)
    with pytest.raises(ValueError, match=r"built for \[batch, 2 kv heads, tokens, head_dim 32\]"):
        cache.update(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64), 1, kwargs={"position_ids": torch.arange(3)[None]})
    with pytest.raises(ValueError, match="has 2 layers"):
        cache.update(torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32), 5, kwargs={"position_ids": torch.arange(3)[None]})


def test_set_attn_implementation_between_calls_is_followed(monkeypatch):
    """Decode steps attend from the codes under whatever attention the model runs at that call (stock sdpa, then
    qcache_fp32) and read the cache under eager attention, with the eager cache's logits each time."""
    from qcache import use_fp32_attention
    from qcache.handover import DecodeStep

    fused = []
    attend = DecodeStep.attend
    monkeypatch.setattr(DecodeStep, "attend", lambda self, *a: fused.append(1) or attend(self, *a))
    model = make_model("llama")
    caches = [QuantCache(bits=4, kernel=k, **OPTS) for k in ("compiled", "eager")]
    with torch.no_grad():
        for cache in caches:
            model(prompt(), cache=cache, use_cache=True)
        for step, attn in enumerate(("sdpa", "qcache_fp32", "eager")):
            use_fp32_attention(model) if attn == "qcache_fp32" else model.set_attn_implementation(attn)
            before = len(fused)
            out = [model(prompt(1, seed=3 + step), cache=c, use_cache=True,
                         position_ids=torch.tensor([[60 + step]])).logits for c in caches]
            torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)
            assert len(fused) - before == (0 if attn == "eager" else 2), attn  # two quantized layers
