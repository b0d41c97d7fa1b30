"""eval/: the lm-eval adapter, our tasks, `python -m eval` and the comparison runner, on a tiny random Llama.

The model (2 layers, hidden 64, head_dim 32) and a word-level tokenizer ("w0".."w255") are written to a temporary
directory: no checkpoint, no download. The word-level tokenizer round-trips exactly (decode then encode gives the
same ids), so text sampled from the model under the default cache is text the default cache predicts best: any
cache that changes what attention reads raises its perplexity by the KL divergence (>= 0), which a 2-bit cache
does clearly and an 8-bit cache hardly at all.
"""

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from eval import compare  # noqa: E402
from eval.adapter import QCacheLM, chunk_bounds, parse_cache_options  # noqa: E402
from eval.harness import offline_environment, task_manager  # noqa: E402
from eval.tasks import qcache_tasks  # noqa: E402
from qcache.presets import recipe
from qcache import QuantCache  # noqa: E402

WORDS = 256
LAYERS = 2
CHUNK = 32


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama + word-level tokenizer saved as a HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    offline_environment()
    path = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = _tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         initializer_range=0.2,  # peaked attention: what the cache stores matters
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def lm(tiny_dir):
    return QCacheLM(pretrained=tiny_dir, cache="quant", bits=4, chunk_size=CHUNK, device="cpu", batch_size=1)


@pytest.fixture(scope="module")
def sampled_text(lm):
    """Two 512-token texts sampled (temperature 1) from the model under the default cache."""
    from transformers import DynamicCache

    texts = []
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(2):
            ids, cache, x = [], DynamicCache(config=lm.model.config), torch.tensor([[1]])  # start after BOS
            for _ in range(512):
                logits = lm.model(x, cache=cache, use_cache=True).logits[0, -1, 3:]  # words only
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)) + 3
                ids.append(token)
                x = torch.tensor([[token]])
            texts.append(lm.tokenizer.decode(ids))
            assert lm.tokenizer(texts[-1])["input_ids"] == ids  # exact round trip
    return texts


def _rolling_nll(lm, texts: list[str]) -> float:
    requests = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(t,), idx=i)
                for i, t in enumerate(texts)]
    return -sum(lm.loglikelihood_rolling(requests, disable_tqdm=True))


# ---------------------------------------------------------------------------------------------------------
# Adapter
# ---------------------------------------------------------------------------------------------------------


def test_parse_cache_options_reads_ints_from_strings():
    assert parse_cache_options({"bits": "4", "k_group_size": "32", "recent_tokens": 0, "rope": "post",
                                "v_group_size": "none", "calibration": "c.safetensors"}) == (
        4, {"k_group_size": 32, "recent_tokens": 0, "rope": "post", "calibration": "c.safetensors"})


def test_parse_cache_options_reads_bools():
    assert parse_cache_options({"static_keys": "False", "codebooks": 1, "clip_search": True}) == (
        None, {"static_keys": False, "codebooks": True, "clip_search": True})


@pytest.mark.parametrize("options, match", [({"bits": "four"}, "bits='four' must be an integer"),
                                            ({"codebooks": "maybe"}, "codebooks='maybe' must be a boolean"),
                                            ({"nbits": 4}, "unknown cache options \\['nbits'\\]")])
def test_parse_cache_options_rejects(options, match):
    with pytest.raises(ValueError, match=match):
        parse_cache_options(options)


def test_set_cache_validates_now(lm):
    with pytest.raises(ValueError, match="cache='fancy' is not supported"):
        lm.set_cache("fancy")
    with pytest.raises(ValueError, match="takes only bits"):
        lm.set_cache("hf-quanto", bits=2, k_bits=4)
    lm.set_cache("quant", bits=4)


def test_calibration_file_reaches_the_cache(lm, sampled_text, tmp_path):
    """`calibration=<file>` in --model_args builds QuantCache.from_calibration."""
    from calibration import calibrate
    from qcache.calibfile import save_calibration

    ids = torch.tensor([lm.tokenizer(t)["input_ids"][:256] for t in sampled_text])  # [2, 256]
    data = calibrate(lm.model, ids, recipe(bits=4), {"model": "tiny", "data_source": "sampled"},
                     progress=False)
    path = save_calibration(tmp_path / "tiny.qcache.safetensors", data)
    lm.set_cache("quant", calibration=str(path))
    try:
        lm._model_call(ids[:1])
        assert lm.last_cache.calibration is not None
    finally:
        lm.set_cache("quant", bits=4)


def test_fp32_attention_option(tiny_dir):
    lm16 = QCacheLM(pretrained=tiny_dir, cache="quant", bits=4, dtype="bfloat16", attn_implementation="qcache_fp32",
                    device="cpu")
    assert lm16.model.config._attn_implementation == "qcache_fp32"
    logits = lm16._model_call(torch.randint(3, WORDS + 3, (1, 70)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


def test_default_cache_chunked_logits_match_one_pass(lm):
    ids = torch.randint(3, WORDS + 3, (2, 3 * CHUNK + 5))
    lm.set_cache("default")
    try:
        chunked = lm._model_call(ids)
    finally:
        lm.set_cache("quant", bits=4)
    with torch.no_grad():
        whole = lm.model(ids).logits
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length, chunk", [(600, 256), (525, 256), (457, 256), (13, 256), (1, 256), (64, 32)])
def test_chunk_bounds_cover_the_input_in_order(length, chunk):
    bounds = chunk_bounds(length, chunk)
    assert [b for _, b in bounds[:-1]] == [a for a, _ in bounds[1:]] and bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(0 < b - a <= chunk for a, b in bounds)
    assert all(b % 8 == 0 for _, b in bounds[:-1])  # every piece but the last ends at a multiple of 8


@pytest.mark.parametrize("bits", [2, 4])
def test_hf_hqq_reads_any_length(lm, bits):
    """457 tokens: fed as 256 + 201, the HQQ cache would re-quantize 457 tokens, which hqq cannot pack."""
    pytest.importorskip("hqq")
    lm.set_cache("hf-hqq", bits=bits)
    lm.chunk_size = 256
    try:
        logits = lm._model_call(torch.randint(3, WORDS + 3, (1, 457)))
    finally:
        lm.chunk_size = CHUNK
        lm.set_cache("quant", bits=4)
    assert logits.shape == (1, 457, WORDS + 3) and torch.isfinite(logits).all()


def test_hf_hqq_generates_after_any_prompt_length(lm):
    """Transformers' own chunked prefill (256 + 201) would re-quantize 457 tokens; ours stops at 456."""
    pytest.importorskip("hqq")
    lm.set_cache("hf-hqq", bits=2)
    lm.chunk_size = 256
    try:
        ids = torch.randint(3, WORDS + 3, (1, 457))
        out = lm._model_generate(ids, max_length=460, stop=[], do_sample=False)
    finally:
        lm.chunk_size = CHUNK
        lm.set_cache("quant", bits=4)
    assert out.shape == (1, 460)


def test_default_cache_generation_matches_plain_generate(lm):
    """Left-padded batch: the chunked prefill gives the tokens one `generate` call gives."""
    prompts = ["w1 w2 w3 " * 30, "w7 w8 " * 12]  # 90 and 24 tokens
    ids, mask = lm.tok_batch_encode(prompts)  # left-padded [2, 90]
    lm.set_cache("default")
    try:
        ours = lm._model_generate(ids, max_length=ids.shape[1] + 6, stop=[], attention_mask=mask, do_sample=False)
    finally:
        lm.set_cache("quant", bits=4)
    with torch.no_grad():
        plain = lm.model.generate(ids, attention_mask=mask, max_length=ids.shape[1] + 6, do_sample=False,
                                  pad_token_id=2)
    assert torch.equal(ours, plain)


def test_perplexity_8bit_close_2bit_worse(lm, sampled_text):
    nll = {}
    tokens = 2 * 512
    for kind, bits in [("default", None), ("quant", 8), ("quant", 2)]:
        lm.set_cache(kind, bits=bits)
        nll[bits] = _rolling_nll(lm, sampled_text) / tokens
    lm.set_cache("quant", bits=4)
    ppl = {bits: math.exp(v) for bits, v in nll.items()}
    assert abs(ppl[8] / ppl[None] - 1) < 0.01, ppl
    assert ppl[2] > 1.2 * ppl[None], ppl


# ---------------------------------------------------------------------------------------------------------
# Tasks through lm-eval
# ---------------------------------------------------------------------------------------------------------


def _evaluate(lm, tiny_dir, tasks, limit, max_gen_toks=None, **metadata):
    from lm_eval.evaluator import evaluate

    loaded = task_manager({"pretrained": tiny_dir, **metadata}).load(tasks)
    compare._prepare(loaded, max_gen_toks)
    return loaded, evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=False)["results"]


def test_loglikelihood_rolling_task_goes_through_quant_cache(lm, tiny_dir):
    lm.set_cache("quant", bits=4)
    updates, built = lm.cache_updates, lm.caches_built
    loaded, results = _evaluate(lm, tiny_dir, ["qcache_ppl"], 1, ppl_doc_chars=600)
    tokens = loaded["tasks"]["qcache_ppl"].test_docs()[0]["num_tokens"]
    assert tokens > 2 * CHUNK
    assert lm.caches_built - built == 1  # one document, one window, one fresh cache
    assert lm.cache_updates - updates == LAYERS * len(chunk_bounds(tokens, CHUNK))  # every chunk, every layer
    assert isinstance(lm.last_cache, QuantCache) and lm.last_cache.memory().packed > 0  # it stored codes
    metrics = results["qcache_ppl"]
    assert metrics["token_perplexity,none"] > 1 and metrics["bits_per_byte,none"] > 0


def test_generate_until_task_goes_through_quant_cache(lm, tiny_dir):
    lm.set_cache("quant", bits=2)
    updates, built = lm.cache_updates, lm.caches_built
    loaded, results = _evaluate(lm, tiny_dir, ["qcache_passkey"], 2, max_seq_lengths=[160], passkey_samples=2)
    prompt_tokens = [doc["prompt_tokens"] for doc in loaded["tasks"]["qcache_passkey"].test_docs()]
    assert lm.caches_built - built == 2  # one fresh cache per prompt
    prefill_calls = sum(len(chunk_bounds(n - 1, CHUNK)) for n in prompt_tokens)  # prompts prefilled in chunks
    # then generate's own calls, per prompt: the last prompt token, and at least one decoding step
    assert lm.cache_updates - updates >= LAYERS * (prefill_calls + 2 * 2)
    assert 0 <= results["qcache_passkey"]["exact_match,none"] <= 1
    lm.set_cache("quant", bits=4)


def test_ruler_niah_task_goes_through_quant_cache(lm, tiny_dir):
    """RULER builds its haystacks with the tokenizer named in the metadata (importing it takes a while: lm-eval
    builds a list of 6M key words)."""
    lm.set_cache("quant", bits=2)
    built = lm.caches_built
    _, results = _evaluate(lm, tiny_dir, ["niah_single_1"], 2, max_seq_lengths=[256], max_gen_toks=4)
    assert lm.caches_built - built == 2
    assert compare._score(results["niah_single_1"], 256) in (0.0, 0.5, 1.0)
    lm.set_cache("quant", bits=4)


def test_score_reads_ruler_and_passkey_keys():
    assert compare._score({"256,none": 1.0, "4096,none": -1}, 256) == 1.0
    assert compare._score({"exact_match,none": 0.5, "exact_match@256,none": 0.5}, 256) == 0.5
    assert compare._score({"4096,none": -1}, 256) is None


# ---------------------------------------------------------------------------------------------------------
# Task data
# ---------------------------------------------------------------------------------------------------------


def test_split_documents_at_paragraphs():
    text = "\n\n".join(f"paragraph {i} " + "x" * 40 for i in range(10))
    docs = qcache_tasks.split_documents(text, 100)
    assert "\n\n".join(docs) == text
    assert all(len(d) >= 100 for d in docs)


@pytest.mark.parametrize("length", [160, 400])
def test_passkey_samples_fit_and_hold_the_key(tiny_dir, length):
    tokenizer = qcache_tasks._load_tokenizer(tiny_dir)
    rows = qcache_tasks.passkey_samples(tokenizer, length, 5, seed=1)
    assert len({r["answer"] for r in rows}) == 5
    budget = length - qcache_tasks.PASSKEY_GEN_RESERVE
    for r in rows:
        assert f"The pass key is {r['answer']}." in r["input"]
        assert r["prompt_tokens"] == len(tokenizer(r["input"])["input_ids"]) <= budget
        assert r["prompt_tokens"] > budget - 40  # filled, not left short (one filler group is 18 words)


def test_passkey_results_exact_match():
    doc = {"answer": "12345", "length": 1024}
    assert qcache_tasks.passkey_results(doc, [" 12345."]) == {"exact_match": 1.0, "exact_match@1024": 1.0}
    assert qcache_tasks.passkey_results(doc, [" 1234"])["exact_match"] == 0.0
    assert qcache_tasks.passkey_results(doc, [" no idea"])["exact_match"] == 0.0


def test_passkey_rows_alternate_lengths(tiny_dir):
    rows = qcache_tasks.passkey(pretrained=tiny_dir, max_seq_lengths=[160, 300], passkey_samples=2)["test"]
    assert rows["length"] == [160, 300, 160, 300]


# ---------------------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------------------


def test_cli_runs_our_task_with_the_adapter(tiny_dir, tmp_path, monkeypatch):
    from eval.__main__ import main

    monkeypatch.chdir(tmp_path)
    main(["--model_args", f"pretrained={tiny_dir},cache=quant,bits=2,chunk_size={CHUNK}", "--tasks", "qcache_ppl",
          "--metadata", '{"ppl_doc_chars": 400}', "--limit", "1", "--output_path", str(tmp_path / "out")])
    (result,) = tmp_path.glob("out/**/results_*.json")
    data = json.loads(result.read_text())
    assert data["config"]["model"] == "qcache"
    assert data["config"]["kv_cache"] == "quant-2bit"
    assert data["results"]["qcache_ppl"]["token_perplexity,none"] > 1


def test_cache_spec_parse():
    spec = compare.CacheSpec.parse("quant:4:recent_tokens=0,sink_tokens=2")
    assert (spec.kind, spec.bits, spec.options) == ("quant", 4, {"recent_tokens": "0", "sink_tokens": "2"})
    assert compare.CacheSpec.parse("quant::k_bits=4,v_bits=2").nominal_bits == 3
    assert compare.CacheSpec.parse("default").nominal_bits == 16
    with pytest.raises(Exception, match="kind 'fancy'"):
        compare.CacheSpec.parse("fancy:4")


def test_compare_writes_json_table_and_plot(tiny_dir, tmp_path):
    out = tmp_path / "eval-tiny"
    report = compare.main(["--model", tiny_dir, "--caches", "default", "quant:8", "quant:2", "hf-quanto:2",
                           "--retrieval-caches", "default", "quant:2", "--retrieval-tasks", "qcache_passkey",
                           "--lengths", "160", "300", "--samples", "1", "--max-gen-toks", "4", "--ppl-docs", "1",
                           "--ppl-doc-chars", "600", "--chunk-size", str(CHUNK), "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["command"].startswith("python -m eval.compare --model")
    assert data["git"] is None or len(data["git"]["commit"]) == 40
    rows = {r["cache"]: r for r in data["perplexity"]}
    assert set(rows) == {"default", "quant-8bit", "quant-2bit", "hf-quanto-2bit"}
    assert "token_perplexity_change_pct" in rows["quant-2bit"] and "token_perplexity_change_pct" not in rows["default"]
    assert {(r["cache"], r["length"]) for r in data["retrieval"]} == {
        (c, n) for c in ("default", "quant-2bit") for n in (160, 300)}
    for row in data["retrieval"]:
        assert row["accuracy"]["qcache_passkey"] in (0.0, 1.0)  # one prompt, scored
    assert "accuracy_delta" in next(r for r in data["retrieval"] if r["cache"] == "quant-2bit")
    table = out.with_suffix(".md").read_text()
    assert "| quant-2bit |" in table and "qcache_passkey @ 300" in table
    assert out.with_suffix(".png").stat().st_size > 1000
    assert report["ppl_tokens"] > 0


def test_compare_parts_can_be_skipped(tiny_dir, tmp_path):
    out = tmp_path / "eval-none"
    report = compare.main(["--model", tiny_dir, "--caches", "--retrieval-caches", "--out", str(out)])
    assert report["perplexity"] == [] and report["retrieval"] == [] and report["ppl_tokens"] is None
    assert "## Perplexity" not in out.with_suffix(".md").read_text() and out.with_suffix(".png").exists()


def test_checkpoint_resumes_same_settings_only(tmp_path):
    path = tmp_path / "run.partial.json"
    first = compare.Checkpoint(path, {"model": "m", "samples": 4}, resume=False)
    first.put("ppl|quant-4bit", {"cache": "quant-4bit", "token_perplexity": 12.5})
    again = compare.Checkpoint(path, {"model": "m", "samples": 4}, resume=True)
    assert again.get("ppl|quant-4bit") == {"cache": "quant-4bit", "token_perplexity": 12.5}
    assert again.get("ppl|default") is None
    assert compare.Checkpoint(path, {"model": "m", "samples": 4}, resume=False).get("ppl|quant-4bit") is None
    with pytest.raises(ValueError, match="other settings"):
        compare.Checkpoint(path, {"model": "m", "samples": 8}, resume=True)
    # rows are keyed by length: a resumed run may ask for other lengths
    assert compare.Checkpoint(path, {"model": "m", "samples": 4, "lengths": [8192]}, resume=True).get("ppl|quant-4bit")
    again.discard()
    assert not path.exists()


def test_auto_calibration_calibrates_for_the_spec(lm, tmp_path, monkeypatch, capsys):
    from qcache.calibfile import load_calibration

    monkeypatch.setenv("QCACHE_HOME", str(tmp_path))
    spec = compare.CacheSpec.parse("quant:2:calibration=auto,outliers=1,v_scale=minmax")
    options = compare.auto_calibration(lm.model, lm.tokenizer, spec)
    progress = capsys.readouterr().err
    assert "calibration forward" in progress and "fit layers" in progress and "100%" in progress  # tqdm bars
    path = Path(options["calibration"])
    assert path.parent == tmp_path / "calibration" and path.is_file() and options["outliers"] == "1"
    data = load_calibration(path)
    assert data.options["k_bits"] == data.options["v_bits"] == 2 and data.options["outliers"] == 1
    assert data.settings["data_source"].endswith("calibration split)")
    try:
        assert compare._use(lm, spec) is None and lm.cache_options["calibration"].endswith(".qcache.safetensors")
    finally:
        lm.set_cache("quant", bits=4)
    assert compare.auto_calibration(lm.model, lm.tokenizer, compare.CacheSpec.parse("quant:2")) == {}


def test_checkpoint_extends_a_finished_report(tmp_path):
    report = tmp_path / "run.json"
    report.write_text(json.dumps({
        "model": "m", "settings": {"samples": 4, "lengths": [1024]},
        "perplexity": [{"cache": "default", "token_perplexity": 10.0},
                       {"cache": "quant-4bit", "token_perplexity": 10.1, "token_perplexity_change_pct": 1.0},
                       {"cache": "hf-hqq-4bit", "error": "unsupported"}],
        "retrieval": [{"cache": "default", "length": 1024, "accuracy": {"t": 1.0}}]}))
    cp = compare.Checkpoint(tmp_path / "run.partial.json", {"model": "m", "samples": 4, "lengths": [1024, 2048]},
                            resume=True, report=report)
    assert cp.get("ppl|quant-4bit") == {"cache": "quant-4bit", "token_perplexity": 10.1}  # delta recomputed later
    assert cp.get("retrieval|default|1024")["accuracy"] == {"t": 1.0}
    assert cp.get("ppl|hf-hqq-4bit") is None and cp.get("retrieval|default|2048") is None  # measured again
    other = tmp_path / "other.partial.json"
    with pytest.raises(ValueError, match="other settings"):
        compare.Checkpoint(other, {"model": "m", "samples": 8}, resume=True, report=report)


def test_compare_keeps_library_warnings(tiny_dir, tmp_path):
    """Without --verbose only lm-eval's per-row INFO lines are dropped: its warnings (here: a metric without an
    aggregation function) still reach the log, and no library's logger level is changed wholesale."""
    import logging

    class Keep(logging.Handler):
        records = []

        def emit(self, record):
            Keep.records.append(record)

    names = ("lm_eval", "transformers", "datasets")
    saved = {name: logging.getLogger(name).level for name in names}
    handler = Keep(level=logging.DEBUG)
    logging.getLogger("lm_eval").addHandler(handler)
    try:
        for name in names:
            logging.getLogger(name).setLevel(logging.INFO)
        compare.main(["--model", tiny_dir, "--caches", "--retrieval-caches", "default", "--retrieval-tasks",
                      "qcache_passkey", "--lengths", "160", "--samples", "1", "--max-gen-toks", "2",
                      "--chunk-size", str(CHUNK), "--out", str(tmp_path / "quiet")])
        after = {name: logging.getLogger(name).level for name in names}
    finally:
        logging.getLogger("lm_eval").removeHandler(handler)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)
    assert after == {name: logging.INFO for name in names}
    warnings = [r for r in Keep.records if r.levelno == logging.WARNING]
    assert any("No aggregation function defined for metric exact_match@160" in r.getMessage() for r in warnings)
    assert not [r for r in Keep.records if r.levelno == logging.INFO and r.name in compare.QUIET_INFO_LOGGERS]
