"""Tiny random models built in the tests (no downloads)."""

import ctypes
import os

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# QuantCache's default kernel="auto" compiles its read (seconds per cache configuration). The unit tests build dozens
# of configurations, so caches left on "auto" read eagerly here (the same values); tests/test_kernels.py exercises
# the compiled paths explicitly and the "auto" choice itself.
os.environ.setdefault("QCACHE_KERNEL", "eager")

# glibc may give an allocation above its mmap threshold fresh pages and hand them back at free, so a large tensor a
# test makes can be page-faulted in anew. On this project's CI machine that once made elementwise ops on a few MiB
# ~10x slower than with the thresholds raised, and later cost nothing measurable (docs/guide.md, "CPU allocator"):
# raised here for the test process and the CLIs it starts, so the suite's time does not depend on it. A property of
# the allocator, not of the cache.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": 1 << 30, "MALLOC_TRIM_THRESHOLD_": 1 << 30}
for _name, _value in _MALLOC.items():
    os.environ.setdefault(_name, str(_value))
try:
    _libc = ctypes.CDLL("libc.so.6")
    _libc.mallopt(-3, _MALLOC["MALLOC_MMAP_THRESHOLD_"])  # M_MMAP_THRESHOLD
    _libc.mallopt(-1, _MALLOC["MALLOC_TRIM_THRESHOLD_"])  # M_TRIM_THRESHOLD
except (OSError, AttributeError):  # not glibc: its allocator's defaults stand
    pass

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=1024, initializer_range=0.05, pad_token_id=0, eos_token_id=None,
              bos_token_id=1)

FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, **COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(num_hidden_layers=2, sliding_window=None, **COMMON)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=24, query_pre_attn_scalar=32, **{**COMMON, "num_key_value_heads": 1})),
}


def make_model(family: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = FAMILIES[family]().eval()
    return model.to(dtype)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models and matrices: one thread is several times faster, and on a busy machine a second one only waits to
    be scheduled. The module's thread count is restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    return request.param
