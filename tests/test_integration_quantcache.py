"""QuantCache on real SmolLM2-135M weights (offline): the answer survives 8- and 4-bit storage."""

import pytest
import torch

from qcache import QuantCache
from qcache.tools.data import read_split
from qcache.tools.models import load_model

QUESTION = "\n\nThe capital of France is"


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def _greedy(model, tokenizer, text, cache, dtype=torch.float32):
    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        out = model.to(dtype).generate(**inputs, max_new_tokens=5, do_sample=False, cache=cache)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.parametrize("bits", [8, 4])
def test_paris_short_prompt(smollm2, bits):
    model, tokenizer = smollm2
    # a 5-token prompt would sit entirely in the full-precision sinks/window with the defaults: quantize everything
    cache = QuantCache(model.config, bits=bits, sink_tokens=0, recent_tokens=0, k_group_size=2)
    assert "Paris" in _greedy(model, tokenizer, "The capital of France is", cache)
    assert cache.memory().packed > 0


# bf16 matmuls are slow on CPUs without bf16 units: one bf16 case (the 4-bit default), both widths in fp32
@pytest.mark.parametrize("bits,dtype", [(8, torch.float32), (4, torch.float32), (4, torch.bfloat16)],
                         ids=["8-fp32", "4-fp32", "4-bf16"])
def test_paris_after_long_context(smollm2, bits, dtype):
    """~900 tokens of prose first (the default cache says Paris after it), so the default settings quantize most of the context."""
    model, tokenizer = smollm2
    preamble = read_split("eval")[:5000]
    cache = QuantCache(bits=bits)  # as a user writes it: the config comes from the model
    text = _greedy(model, tokenizer, preamble + QUESTION, cache, dtype)
    model.to(torch.float32)
    assert "Paris" in text, text
    layer = cache.layers[0]
    assert layer.quantized_length > 0.7 * layer.stored_length()  # most of the context is stored packed


def test_default_rotates_every_smollm2_layers_keys(smollm2):
    """rotate="auto" on the real weights: every layer's estimate is below 1 (bench/key_rotation.py measured rotated
    keys winning in all 30 layers with real queries), so the default is rotate="kv" throughout."""
    model, tokenizer = smollm2
    cache = QuantCache(bits=4)
    with torch.no_grad():
        model(**tokenizer("The capital of France is", return_tensors="pt"), cache=cache)
    choice = cache.key_rotation
    assert len(choice) == 30 and all(c["rotate"] == "kv" and 0.5 < c["ratio"] < 1 for c in choice.values())
