"""The Transformers floor and the checks that keep a run from measuring a cache other than the one it names.

A model that does not take `cache=` (a Transformers release before the floor, or a wrapper that drops the keyword)
builds a full-precision DynamicCache of its own and answers without an error; the models here simulate that by
dropping the keyword, and the perplexity helper and the lm-eval adapter must refuse to report such a run.
"""

import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from conftest import make_model
from qcache import QuantCache
from qcache._compat import (
    TRANSFORMERS_FIX,
    TRANSFORMERS_FLOOR,
    CacheNotWrittenError,
    TransformersVersionError,
    check_transformers,
    transformers_supported,
)
from eval.perplexity import chunked_nll

ROOT = Path(__file__).resolve().parents[1]
OPTS = dict(bits=8, recent_tokens=8, k_group_size=16, sink_tokens=2)


@pytest.mark.parametrize("version, supported", [
    ("5.24.0", True), ("5.24.0.dev0", True), ("5.30.2", True),
    ("5.23.0", False), ("5.22.2", False), ("5.18.0", False), ("5.0.0", False), ("4.57.6", False), ("6.0.0", False),
])
def test_supported_range(version, supported):
    assert transformers_supported(version) is supported


@pytest.mark.parametrize("version", ["5.23.0", "4.57.6", "6.0.0", "not-a-version"])
def test_unsupported_release_is_refused_with_the_fix(version):
    with pytest.raises(TransformersVersionError, match=r"pip install 'transformers>=5\.24,<6'") as err:
        check_transformers(version)
    assert isinstance(err.value, ImportError)


def test_installed_release_is_supported():
    import transformers

    assert check_transformers() == transformers.__version__


def test_pyproject_pins_the_floor_the_check_enforces():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("transformers")]
    floor = ".".join(map(str, TRANSFORMERS_FLOOR))
    assert pin == f"transformers>={floor},<6"
    assert f"'{pin}'" in TRANSFORMERS_FIX


def test_quant_cache_refuses_an_old_transformers(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    with pytest.raises(TransformersVersionError, match="pip install"):
        QuantCache(bits=4)


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_both_keywords_reach_the_cache_in_a_forward(llama, keyword):
    cache = QuantCache(llama.config, **OPTS)
    with torch.no_grad():
        llama(_ids(1, 40), use_cache=True, **{keyword: cache})
    assert cache.get_seq_length() == 40 and cache.layers[0].quantized_length == 16


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_both_keywords_reach_the_cache_in_generate(llama, keyword):
    """As the README writes it: `generate(..., past_key_values=QuantCache(bits=...))` (no config)."""
    cache = QuantCache(**OPTS)
    with torch.no_grad():
        out = llama.generate(_ids(1, 40), max_new_tokens=10, min_new_tokens=10, do_sample=False, **{keyword: cache})
    assert out.shape == (1, 50) and cache.get_seq_length() == 49 and cache.layers[0].quantized_length == 32


def test_cache_keyword_is_the_one_transformers_does_not_deprecate(llama):
    """`cache=` (transformers >= 5.24) runs without a deprecation warning in forward and generate; the README's
    `past_key_values=` keeps working (the tests above) while transformers accepts it (5.24 and 5.25 warn)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            llama(_ids(1, 40), use_cache=True, cache=QuantCache(llama.config, **OPTS))
            llama.generate(_ids(1, 40), max_new_tokens=3, do_sample=False, cache=QuantCache(**OPTS))
    deprecations = [str(w.message) for w in caught if "deprecated" in str(w.message)]
    assert deprecations == []


# ---------------------------------------------------------------------------------------------------------
# a cache handed to a model that does not use it
# ---------------------------------------------------------------------------------------------------------


class DropsCache(nn.Module):
    """A model whose forward loses `cache=` (as `**kwargs` did before the floor): it builds its own cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, cache=None, **kwargs):
        return self.model(input_ids, **kwargs)


CACHES = {"quant-8bit": lambda model: QuantCache(model.config, **OPTS),
          "default": lambda model: DynamicCache(config=model.config)}


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


def _ids(n=2, length=70):
    return torch.randint(2, 96, (n, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_perplexity_reads_through_the_cache_it_was_given(llama, kind):
    caches = []

    def make():
        caches.append(CACHES[kind](llama))
        return caches[-1]

    nll, count = chunked_nll(llama, _ids(), make, chunk=32)
    assert count == 2 * 69 and nll > 0
    assert caches[0].get_seq_length() == 70


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_perplexity_refuses_a_model_that_drops_the_cache(llama, kind):
    expected = r"chunk at token 0: .* holds 0 tokens after 32 more .*\(expected 32\)"
    with pytest.raises(CacheNotWrittenError, match=expected):
        chunked_nll(DropsCache(llama), _ids(), lambda: CACHES[kind](llama), chunk=32)


def test_perplexity_refuses_a_factory_that_builds_no_cache(llama):
    with pytest.raises(ValueError, match="make_cache\\(\\) returned NoneType"):
        chunked_nll(llama, _ids(), lambda: None, chunk=32)


# ---------------------------------------------------------------------------------------------------------
# the lm-eval adapter
# ---------------------------------------------------------------------------------------------------------

WORDS = 64


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """QCacheLM on a tiny random Llama + word-level tokenizer saved to a temporary directory."""
    pytest.importorskip("lm_eval")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from eval.adapter import QCacheLM
    from eval.harness import offline_environment

    offline_environment()
    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="</s>").save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=1,
                                 eos_token_id=2, pad_token_id=2)).eval().save_pretrained(path)
    return QCacheLM(pretrained=str(path), cache="quant", bits=8, recent_tokens=8, k_group_size=16, chunk_size=16,
                    device="cpu", batch_size=1)


def _drop_cache(model: nn.Module, monkeypatch, decode_only: bool = False) -> None:
    """Make `model` lose `cache=` (only on one-token decode steps with `decode_only`)."""
    forward = model.forward

    def forward_losing_cache(input_ids=None, cache=None, **kwargs):
        if decode_only and input_ids.shape[1] > 1:
            return forward(input_ids, cache=cache, **kwargs)
        return forward(input_ids, **kwargs)

    monkeypatch.setattr(model, "forward", forward_losing_cache)


def test_adapter_logits_come_from_its_cache(lm):
    ids = torch.randint(3, WORDS + 3, (1, 40))
    logits = lm._model_call(ids)
    assert logits.shape == (1, 40, WORDS + 3)
    assert lm.last_cache.get_seq_length() == 40 and lm.last_cache.layers[0].quantized_length > 0


def test_adapter_generation_comes_from_its_cache(lm):
    ids = torch.randint(3, WORDS + 3, (1, 40))
    out = lm._model_generate(ids, max_length=46, stop=[], do_sample=False)
    assert out.shape == (1, 46) and lm.last_cache.get_seq_length() == 45


def test_adapter_refuses_logits_from_another_cache(lm, monkeypatch):
    _drop_cache(lm.model, monkeypatch)
    with pytest.raises(CacheNotWrittenError, match="log-likelihood, tokens 0:16: the QuantCache"):
        lm._model_call(torch.randint(3, WORDS + 3, (1, 40)))


def test_adapter_refuses_a_prefill_into_another_cache(lm, monkeypatch):
    _drop_cache(lm.model, monkeypatch)
    with pytest.raises(CacheNotWrittenError, match="prefill, tokens 0:16"):
        lm._model_generate(torch.randint(3, WORDS + 3, (1, 40)), max_length=46, stop=[], do_sample=False)


def test_adapter_refuses_decoding_from_another_cache(lm, monkeypatch):
    """The prefill lands in the cache; generate's one-token steps do not."""
    _drop_cache(lm.model, monkeypatch, decode_only=True)
    with pytest.raises(CacheNotWrittenError, match=r"generate: .* holds 39 tokens .*\(expected 45\)"):
        lm._model_generate(torch.randint(3, WORDS + 3, (1, 40)), max_length=46, stop=[], do_sample=False)


def test_ci_runs_the_readme_test_command_and_the_floor_it_declares():
    """`.ci/run`'s first job is the README's test command (pip's -q aside); its floor job pins the floor that
    pyproject.toml and qcache/_compat.py declare."""
    import re

    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    (readme_line,) = [line for line in readme.splitlines() if line.endswith("python -m pytest -q")]
    ci_lines = [line.replace("pip install -q ", "pip install ") for line in ci.splitlines()
                if line.endswith("python -m pytest -q")]
    assert ci_lines == [readme_line]
    floor = ".".join(map(str, TRANSFORMERS_FLOOR))
    assert re.search(rf'^FLOOR="transformers=={re.escape(floor)}\.\*"$', ci, re.M)
