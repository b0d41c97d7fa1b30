"""lm-eval's own routes to our adapter and tasks, on a tiny random Llama saved to a temporary directory:

    lm_eval.simple_evaluate(model=QCacheLM(...), tasks=[...], task_manager=eval.harness.task_manager(...))
    lm_eval.simple_evaluate(model="qcache", model_args="...")   (the name is registered by importing eval.adapter)
    the stock CLI: python -m lm_eval run --model hf --include_path eval/tasks --tasks qcache_ppl ...
    python -m eval (lm-eval's console entry point with our defaults): the command line it hands to lm-eval
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402

from eval.__main__ import rewrite_argv  # noqa: E402
from eval.adapter import QCacheLM  # noqa: E402
from eval.harness import TASKS_DIR, offline_environment, task_manager  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORDS = 256
CHUNK = 32
DOC_CHARS = 400


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama + word-level tokenizer ("w0".."w255") saved as a HF directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    offline_environment()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def lm(tiny_dir):
    return QCacheLM(pretrained=tiny_dir, cache="quant", bits=4, chunk_size=CHUNK, device="cpu", batch_size=1)


def _ppl(results: dict) -> float:
    return results["results"]["qcache_ppl"]["word_perplexity,none"]


def _simple_evaluate(model, tiny_dir, **kwargs):
    return lm_eval.simple_evaluate(model=model, tasks=["qcache_ppl"], limit=1, bootstrap_iters=0,
                                   task_manager=task_manager({"pretrained": tiny_dir, "ppl_doc_chars": DOC_CHARS}),
                                   **kwargs)


def test_simple_evaluate_with_a_qcache_lm(lm, tiny_dir):
    """The LM object route: every forward goes through the chosen cache, and the cache changes the result."""
    ppl = {}
    for kind, bits in (("default", None), ("quant", 2)):
        lm.set_cache(kind, bits=bits)
        updates, built = lm.cache_updates, lm.caches_built
        results = _simple_evaluate(lm, tiny_dir)
        assert lm.caches_built - built == 1 and lm.cache_updates - updates >= 2 * 2  # layers x chunks
        ppl[kind] = _ppl(results)
    lm.set_cache("quant", bits=4)
    assert results["config"]["model"] == tiny_dir and results["config"]["kv_cache"] == "quant-2bit"
    assert ppl["quant"] > ppl["default"] > 1  # the 2-bit cache is what was measured


def test_simple_evaluate_by_registered_name(tiny_dir):
    results = _simple_evaluate("qcache", tiny_dir, device="cpu",
                               model_args=f"pretrained={tiny_dir},cache=quant,bits=2,chunk_size={CHUNK}")
    assert results["config"]["model"] == "qcache" and results["config"]["kv_cache"] == "quant-2bit"
    assert _ppl(results) > 1


def _offline_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_stock_lm_eval_cli_with_include_path(tiny_dir, lm, tmp_path):
    """`lm_eval run --model hf --include_path eval/tasks`: lm-eval's own model on our task, in a fresh process;
    it scores what our adapter's default cache scores (same windows, logits equal to one pass)."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={tiny_dir}",
               "--include_path", str(TASKS_DIR), "--tasks", "qcache_ppl", "--metadata",
               json.dumps({"ppl_doc_chars": DOC_CHARS}), "--limit", "1", "--device", "cpu", "--output_path", str(out)]
    done = subprocess.run(command, cwd=tmp_path, env=_offline_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = out.glob("**/results_*.json")
    stock = json.loads(result.read_text())
    assert stock["config"]["model"] == "hf"
    lm.set_cache("default")
    try:
        ours = _simple_evaluate(lm, tiny_dir)
    finally:
        lm.set_cache("quant", bits=4)
    assert stock["results"]["qcache_ppl"]["word_perplexity,none"] == pytest.approx(_ppl(ours), rel=1e-4)


def test_stock_lm_eval_cli_does_not_know_qcache_without_the_adapter(tiny_dir, tmp_path):
    """lm-eval 0.4 has no plugin discovery for models: `--model qcache` needs eval.adapter imported, which is
    what `python -m eval` does. If a future lm-eval resolves it, this test tells us to document that route."""
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "qcache", "--model_args", f"pretrained={tiny_dir}",
               "--include_path", str(TASKS_DIR), "--tasks", "qcache_ppl", "--limit", "1", "--device", "cpu"]
    done = subprocess.run(command, cwd=tmp_path, env=_offline_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "qcache" in done.stderr and "no model for this name" in done.stderr


# ---------------------------------------------------------------------------------------------------------
# python -m eval: the command line it hands to lm-eval's console entry point
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def short_names(monkeypatch):
    """Short names resolve to /models/<name> (no conversion); other names pass through."""
    monkeypatch.setattr("qcache.tools.models.resolve_model",
                        lambda name, cache_dir=None: f"/models/{name}" if name in ("smollm2-135m", "gemma3-270m")
                        else name)


@pytest.mark.parametrize("argv, expected", [
    (["--tasks", "qcache_ppl"],
     ["run", "--tasks", "qcache_ppl", "--include_path", str(TASKS_DIR), "--model", "qcache", "--device", "cpu"]),
    (["run", "--model", "hf", "--device", "cpu", "--tasks", "x"],
     ["run", "--model", "hf", "--device", "cpu", "--tasks", "x", "--include_path", str(TASKS_DIR)]),
    (["--model_args", "pretrained=smollm2-135m,cache=quant", "bits=4", "--device=cpu"],
     ["run", "--model_args", "pretrained=/models/smollm2-135m,cache=quant", "bits=4", "--device=cpu",
      "--include_path", str(TASKS_DIR), "--model", "qcache"]),
    (["--model_args=pretrained=gemma3-270m", "--metadata", '{"tokenizer": "smollm2-135m", "max_seq_lengths": [64]}',
      "--device", "cpu"],
     ["run", "--model_args=pretrained=/models/gemma3-270m", "--metadata",
      '{"tokenizer": "/models/smollm2-135m", "max_seq_lengths": [64]}', "--device", "cpu",
      "--include_path", str(TASKS_DIR), "--model", "qcache"]),
    (["ls", "tasks"], ["ls", "tasks", "--include_path", str(TASKS_DIR)]),
    (["--help"], ["--help"]),
])
def test_python_m_eval_command_line(short_names, monkeypatch, argv, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rewrite_argv(argv) == expected


def test_python_m_eval_refuses_a_second_include_path():
    with pytest.raises(ValueError, match="adds --include_path .* itself and lm-eval's CLI takes only one"):
        rewrite_argv(["--tasks", "x", "--include_path", "/my/tasks"])


def test_python_m_eval_uses_lm_evals_console_entry_point():
    """The entry point `python -m eval` calls is the one lm-eval's `lm_eval` command is installed with."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "lm_eval"]
    assert script.value == "lm_eval.__main__:cli_evaluate"
    source = (ROOT / "eval" / "__main__.py").read_text()
    assert "from lm_eval.__main__ import cli_evaluate" in source and "lm_eval._cli" not in source
