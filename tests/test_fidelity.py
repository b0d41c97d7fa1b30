"""eval.fidelity and calibration.needles on tiny models built here (no checkpoint, no download).

* KL / top-1 / Δ PPL: a random 2-layer Llama; the default cache against itself, and caches that add noise to the
  values they store (more noise, more divergence).
* Bits per value held: hand counts of the default cache's tensors (a full-attention Llama and a Gemma-3 with
  sliding layers) and of an object holding known tensors.
* Needles: a 1-layer Llama constructed to copy. Its queries are zero, so every position attends uniformly to all
  tokens so far; values carry each token's one-hot code into a half of the residual stream that only the output
  head reads, so the logit of a token grows with how often it occurred in the context. A needle whose answer
  tokens were inserted into the context must then score higher than one whose answer never occurred, and only if
  the scorer really reads the filled cache: through a fresh cache both answers are equally absent (tested too).
* The CLI: argument errors, and a whole run on a tiny model directory (byte-level tokenizer built here).
"""

import json
import math
import types

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

pytest.importorskip("lm_eval")

from eval import fidelity  # noqa: E402
from eval.fidelity import (  # noqa: E402
    CacheTrack,
    ChunkSums,
    bits_per_value_held,
    lockstep_document,
    pareto_front,
    summarize_fidelity,
    values_held,
)
from calibration.needles import (  # noqa: E402
    Needle,
    build_needles,
    fill_cache,
    needle_text,
    score_needles,
    score_suffix,
    wilson_interval,
)
from eval.caches import build_cache, cache_label  # noqa: E402
from qcache.tools.footprint import reachable_bytes  # noqa: E402

VOCAB, CONTEXT, CHUNK = 96, 192, 32


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def tiny_llama(dtype=torch.float32, seed=0, layers=2):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return LlamaForCausalLM(config).eval().to(dtype)


def tiny_gemma3(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              sliding_window=24, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                              query_pre_attn_scalar=32, max_position_embeddings=1024, pad_token_id=0,
                              bos_token_id=1, eos_token_id=None)
    return Gemma3ForCausalLM(config).eval().to(dtype)


class NoisyValues(DynamicCache):
    """A default cache that stores its values with seeded Gaussian noise of `scale` x their std."""

    def __init__(self, config, scale: float):
        super().__init__(config=config)
        self.scale, self.gen = scale, torch.Generator().manual_seed(0)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        noise = torch.randn(value_states.shape, generator=self.gen, dtype=torch.float32)
        value_states = value_states + (self.scale * value_states.float().std() * noise).to(value_states.dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def lockstep(model, candidates: dict, docs: int = 2):
    """Run `docs` random documents through the default cache and `candidates` {label: factory}; summaries."""
    torch.manual_seed(1)
    ids = torch.randint(2, VOCAB, (docs, CONTEXT))
    reference = CacheTrack("default", lambda: DynamicCache(config=model.config))
    tracks = [CacheTrack(label, make) for label, make in candidates.items()]
    for doc in range(docs):
        lockstep_document(model, ids[doc], doc, reference, tracks, CHUNK, score_start=CONTEXT // 2)
    return reference, {t.label: (t, summarize_fidelity(t.chunks, resamples=200) if t.error is None else None)
                       for t in tracks}


# ---------------------------------------------------------------------------------------------------------
# KL, top-1, Δ PPL
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_against_itself_gives_kl_zero_and_top1_one(dtype):
    model = tiny_llama(dtype)
    _, results = lockstep(model, {"default-again": lambda: DynamicCache(config=model.config)})
    track, s = results["default-again"]
    assert track.error is None
    assert s["tokens"] == 2 * (CONTEXT - 1 - CONTEXT // 2)  # every scored prediction of both documents
    assert s["kl"] == 0.0 and s["top1"] == 1.0 and s["delta_ppl_pct"] == 0.0
    assert s["ci95"]["kl"] == [0.0, 0.0] and s["kl_doc_range"] == [0.0, 0.0]


@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_cache_perturbing_values_gives_kl_above_zero_and_lower_top1(scale):
    model = tiny_llama()
    _, results = lockstep(model, {"noisy": lambda: NoisyValues(model.config, scale)})
    _, s = results["noisy"]
    assert s["kl"] > 1e-4
    assert s["top1"] < 1.0
    assert s["ci95"]["kl"][0] > 0.0  # every resample of the chunks sees the divergence


def test_more_noise_diverges_more():
    model = tiny_llama()
    _, results = lockstep(model, {f"noise-{x}": (lambda x=x: NoisyValues(model.config, x)) for x in (0.1, 1.0, 4.0)})
    kls = [results[f"noise-{x}"][1]["kl"] for x in (0.1, 1.0, 4.0)]
    assert kls[0] < kls[1] < kls[2]


def test_a_failing_cache_is_recorded_and_the_others_go_on():
    model = tiny_llama()

    class Broken(DynamicCache):
        def update(self, key_states, *args, **kwargs):
            if self.get_seq_length() >= 64:
                raise RuntimeError("broken on purpose")
            return super().update(key_states, *args, **kwargs)

    _, results = lockstep(model, {"broken": lambda: Broken(config=model.config),
                                  "fine": lambda: DynamicCache(config=model.config)})
    assert results["broken"][0].error == "RuntimeError: broken on purpose"
    assert results["fine"][0].error is None and results["fine"][1]["kl"] == 0.0


def test_summary_pools_tokens_and_reports_each_document():
    chunks = [ChunkSums(0, 0, 10, 1.0, 10, 12.0, 10.0), ChunkSums(1, 0, 30, 0.6, 15, 30.0, 30.0)]
    s = summarize_fidelity(chunks, resamples=100)
    assert s["kl"] == pytest.approx(1.6 / 40) and s["top1"] == pytest.approx(25 / 40)
    assert s["delta_ppl_pct"] == pytest.approx(100 * math.expm1(2.0 / 40))
    assert [d["kl"] for d in s["per_doc"]] == pytest.approx([0.1, 0.02])
    assert s["kl_doc_range"] == pytest.approx([0.02, 0.1])
    lo, hi = s["ci95"]["kl"]
    assert 0.02 <= lo <= s["kl"] <= hi <= 0.1


def test_pareto_front_keeps_only_undominated_points():
    points = [(16.0, 0.0), (4.5, 0.01), (4.4, 0.02), (5.0, 0.05), (2.5, 0.3), (2.6, 0.2)]
    assert pareto_front(points) == [4, 5, 2, 1, 0]


# ---------------------------------------------------------------------------------------------------------
# Bits per value held
# ---------------------------------------------------------------------------------------------------------


def _filled_default(model, tokens):
    cache = DynamicCache(config=model.config)
    fill_cache(model, cache, torch.randint(2, VOCAB, (1, tokens)), chunk=CHUNK)
    return cache


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 16.0), (torch.float32, 32.0)])
def test_default_llama_cache_holds_exactly_its_dtype_bits(dtype, bits):
    model = tiny_llama(dtype)
    cache = _filled_default(model, 100)
    assert values_held(cache) == 2 * 2 * 2 * 100 * 16  # layers x kv heads x tokens x head_dim x (K, V)
    assert bits_per_value_held(cache, values_held(cache)) == bits


def test_values_held_caps_sliding_layers_at_their_window():
    model = tiny_gemma3(torch.bfloat16)
    cache = _filled_default(model, 100)
    held = [min(100, 24 - 1), 100, min(100, 24 - 1)]  # Transformers keeps window - 1 tokens of a sliding layer
    assert values_held(cache) == sum(2 * 1 * t * 32 for t in held)
    # what it holds beyond those values: the storage its sliding layers' views keep, and their window tensors
    extra = reachable_bytes(cache) - 2 * values_held(cache)
    assert extra >= 0 and bits_per_value_held(cache, values_held(cache)) == 16.0 + 8 * extra / values_held(cache)


def test_bits_per_value_counts_every_tensor_once():
    codes = torch.zeros(1000, dtype=torch.uint8)
    held = types.SimpleNamespace(codes=codes, view=codes[:10], scales=[torch.zeros(50, dtype=torch.float16)],
                                 extra={"positions": torch.zeros(25, dtype=torch.int32)}, name="not a tensor")
    # 1000 code bytes (the view shares them) + 50 x 2 scale bytes + 25 x 4 position bytes, over 400 values
    assert bits_per_value_held(held, 400) == (1000 + 100 + 100) * 8 / 400
    with pytest.raises(ValueError, match="values=0"):
        bits_per_value_held(held, 0)


def test_values_held_rejects_a_cache_without_keys():
    with pytest.raises(ValueError, match="layer 0"):
        values_held(types.SimpleNamespace(layers=[types.SimpleNamespace()]))


# ---------------------------------------------------------------------------------------------------------
# Needles
# ---------------------------------------------------------------------------------------------------------

COPY_VOCAB = 64


def copying_model():
    """1 layer; zero queries (uniform attention over the context); a token's one-hot code goes through the values
    into the upper half of the residual stream, which is all the output head reads: logits grow with how often a
    token occurred so far."""
    config = LlamaConfig(vocab_size=COPY_VOCAB, hidden_size=2 * COPY_VOCAB, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=COPY_VOCAB // 2,  # 4 x 32 = 2V
                         max_position_embeddings=2048, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                         eos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    eye = torch.eye(COPY_VOCAB)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight[:, :COPY_VOCAB] = eye  # token t -> channel t (lower half)
        layer = model.model.layers[0]
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
        # v_proj [kv_heads * head_dim, hidden] = [2V, 2V]: the lower half (the one-hot code) into the first V channels
        layer.self_attn.v_proj.weight[:COPY_VOCAB, :COPY_VOCAB] = eye
        layer.self_attn.o_proj.weight[COPY_VOCAB:, :COPY_VOCAB] = eye  # [hidden, heads * head_dim]: -> upper half
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight[:, COPY_VOCAB:] = 20 * eye  # reads the upper half only
    return model


def _needle(key_token, answer):
    return Needle(f"k{key_token}", "".join(map(str, answer)), 0.5, 0, (5, key_token, 6), tuple(answer))


def _copy_context(length=300, inserted=(40, 41, 42)):
    torch.manual_seed(0)
    ids = torch.randint(8, 32, (1, length))  # haystack tokens 8..31; answers use 40..47
    ids[0, length // 2:length // 2 + len(inserted)] = torch.tensor(inserted)
    return ids


CACHE_KINDS = {"default": ("default", None, {}), "quant-4bit": ("quant", 4, {}),
               "quant-2bit": ("quant", 2, {"k_group_size": 16, "recent_tokens": 8})}


@pytest.mark.parametrize("kind", sorted(CACHE_KINDS))
def test_needle_copied_into_the_context_scores_higher_than_an_absent_one(kind):
    model = copying_model()
    name, bits, options = CACHE_KINDS[kind]
    cache = fill_cache(model, build_cache(name, model.config, bits, **options), _copy_context(), chunk=64)
    present, absent = _needle(7, (40, 41, 42)), _needle(7, (45, 46, 47))
    s_present, s_absent = score_needles(model, cache, [present, absent])
    assert s_present.logprob > s_absent.logprob + 1.0  # nats
    # through an empty cache neither answer occurred: the same score, so the gap above comes from the context
    e_present, e_absent = score_needles(model, build_cache(name, model.config, bits, **options), [present, absent])
    assert e_present.logprob == pytest.approx(e_absent.logprob, abs=1e-5)


PEERS = {"hf-quanto-4bit": ("hf-quanto", 4, {}), "hf-hqq-2bit": ("hf-hqq", 2, {}), "hf-fp8": ("hf-fp8", None, {})}


@pytest.mark.parametrize("kind", sorted(CACHE_KINDS) + sorted(PEERS))
def test_needles_scored_from_one_fill_equal_needles_scored_alone(kind):
    """Each needle runs through its own copy: the filled cache is unchanged, and an earlier needle's question
    (here long enough to make a QuantCache quantize a block) never reaches a later needle. Transformers' caches
    too (quanto's tensors cannot be deep-copied: they are shared, and never written into)."""
    model = copying_model()
    name, bits, options = {**CACHE_KINDS, **PEERS}[kind]
    if name in ("hf-quanto", "hf-hqq"):
        pytest.importorskip("optimum.quanto" if name == "hf-quanto" else "hqq")
    ids = _copy_context(length=256)  # 2 chunks of 128, as eval.fidelity aligns fills: the peers hold no residual
    long_question = Needle("long", "x", 0.5, 0, tuple(range(48, 64)) * 4, (40, 41))  # 64 question tokens
    later = _needle(9, (40, 41, 42))
    cache = fill_cache(model, build_cache(name, model.config, bits, **options), ids, chunk=128)
    before = (cache.get_seq_length(), reachable_bytes(cache))
    together = score_needles(model, cache, [long_question, later])
    assert (cache.get_seq_length(), reachable_bytes(cache)) == before
    alone = score_needles(model, fill_cache(model, build_cache(name, model.config, bits, **options), ids, chunk=128),
                          [later])
    assert together[1] == alone[0]


def test_score_suffix_margin_and_found():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 2.5]])  # answer [1, 2]: both argmax
    logprob, margin, found = score_suffix(logits, [1, 2])
    expected = torch.log_softmax(logits, -1)
    assert logprob == pytest.approx(float(expected[0, 1] + expected[1, 2]))
    assert margin == pytest.approx(0.5) and found
    assert score_suffix(logits, [1, 0])[1:] == (pytest.approx(-0.5), False)
    with pytest.raises(ValueError, match="3 answer tokens"):
        score_suffix(logits, [1, 2, 0])


@pytest.mark.parametrize("k,n,lo,hi", [(30, 30, 0.8865, 1.0), (0, 30, 0.0, 0.1135), (15, 30, 0.3315, 0.6685)])
def test_wilson_interval(k, n, lo, hi):
    assert wilson_interval(k, n) == (pytest.approx(lo, abs=1e-4), pytest.approx(hi, abs=1e-4))


def byte_tokenizer(bos: bool = False):
    """A byte-level tokenizer built here: every byte one token (256), plus <s> (256) and <pad> (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<s>": 256, "<pad>": 257})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", pad_token="<pad>")


TEXT = " ".join(f"Sentence number {i} tells of kings and rivers." for i in range(400))


@pytest.mark.parametrize("bos,align,values", [(False, 1, "number"), (True, 1, "number"), (False, 128, "number"),
                                              (False, 1, "word")])
def test_build_needles_places_every_needle_and_fits_the_length(bos, align, values):
    tok = byte_tokenizer(bos)
    ids, needles = build_needles(tok, TEXT, length=4000, count=12, seed=3, align=align, values=values)
    longest = max(len(n.suffix_ids) for n in needles)
    assert ids.shape == (1, (4000 - longest) // align * align)
    assert (ids[0, 0].item() == 256) == bos  # the tokenizer's own leading token, when it has one
    assert len({n.key for n in needles}) == 12 and len({n.value for n in needles}) == 12
    depths = [n.depth for n in needles]
    assert depths == sorted(depths) and 0.04 < depths[0] and depths[-1] < 0.97
    for n in needles:  # the needle sits where it says, after a full stop, and its answer is its value
        text = tok.decode(ids[0, n.position:n.position + 80])
        assert text.startswith(needle_text(n.key, n.value, values)) and f" {n.key} {n.value}." in text
        assert tok.decode(ids[0, n.position - 1:n.position]) == "."
        assert tok.decode(list(n.answer_ids)) == f" {n.value}" and n.value.isdigit() == (values == "number")
        assert tok.decode(list(n.question_ids)).endswith(f"of {n.key}?\nAnswer: The secret {values} of {n.key} is "
                                                         f"{n.key}")


def test_build_needles_is_seeded():
    tok = byte_tokenizer()
    a, b, c = (build_needles(tok, TEXT, 3000, 8, seed=s) for s in (1, 1, 2))
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert [n.value for n in a[1]] != [n.value for n in c[1]]


@pytest.mark.parametrize("kwargs,match", [
    ({"length": 0, "count": 4}, "length=0"),
    ({"length": 3000, "count": 0}, "count=0"),
    ({"length": 400, "count": 10}, "too short"),
    ({"length": 3000, "count": 30}, r"only \d+ keys are absent from the text and start with distinct tokens"),
    ({"length": 3000, "count": 4, "values": "colour"}, "values='colour'"),
    ({"length": 3000, "count": 4, "align": 0}, "align=0"),
])
def test_build_needles_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_needles(byte_tokenizer(), TEXT, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--caches", "bogus:4"], "kind 'bogus' is not supported; allowed"),
    (["--caches", "quant:four"], "bits 'four' must be an integer"),
    (["--caches", "quant:4:recent_tokens"], "must be NAME=VALUE"),
    (["--caches", "quant:4", "quant:4"], "listed more than once"),
    (["--context", "0"], "context=0 must be a positive integer"),
    (["--docs", "0"], "docs=0 must be a positive integer"),
    (["--needles", "0"], "needles=0 must be a positive integer"),
    (["--lengths", "2048", "2048"], "repeats a length"),
    (["--score-from", "1.5"], r"score_from=1.5 must be in \[0, 1\)"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
    (["--model", "/nowhere/model"], "has no defaults.*pass --context, --docs, --lengths"),
])
def test_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        fidelity.main(argv)
    assert exc.value.code == 2
    import re

    assert re.search(message, capsys.readouterr().err)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Gemma-3 (sliding + full layers) with the byte tokenizer (<s> first), saved as a model directory."""
    path = tmp_path_factory.mktemp("tiny-gemma3")
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                              max_position_embeddings=1024, pad_token_id=257, bos_token_id=256, eos_token_id=None)
    Gemma3ForCausalLM(config).save_pretrained(path)
    byte_tokenizer(bos=True).save_pretrained(path)
    return path


def test_cli_rejects_contexts_beyond_the_model(model_dir, capsys):
    with pytest.raises(SystemExit):
        fidelity.main(["--model", str(model_dir), "--context", "2048", "--docs", "1", "--lengths"])
    assert "context=2048 exceeds the model's max_position_embeddings=1024" in capsys.readouterr().err


def test_cli_run_writes_json_markdown_and_plot(model_dir, tmp_path):
    out = tmp_path / "fid"
    # 512 tokens: more than the sinks, a 128-token key block and 128 recent tokens, so most of the cache is quantized
    report = fidelity.main(["--model", str(model_dir), "--context", "512", "--docs", "2", "--chunk", "64",
                            "--caches", "quant:4", "quant:2", "hf-quanto:4", "--lengths", "512", "--needles", "4",
                            "--bootstrap", "50", "--out", str(out), "--no-progress"])
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["command"].startswith("python -m eval.fidelity --model")
    assert set(saved["git"]) == {"commit", "dirty"} and saved["timings"]["total"] > 0
    rows = {r["cache"]: r for r in saved["fidelity"]}
    assert list(rows) == ["default", "quant-4bit", "quant-2bit", "hf-quanto-4bit"]  # the reference first
    assert rows["default"]["reference"] and "sliding" in rows["hf-quanto-4bit"]["refused"]
    assert 0 < rows["quant-4bit"]["kl"] < rows["quant-2bit"]["kl"]
    assert rows["quant-2bit"]["bits_per_value"] < rows["quant-4bit"]["bits_per_value"]
    assert rows["quant-4bit"]["tokens"] == 2 * 255
    needles = [r for r in saved["needles"] if "refused" not in r]
    assert [r["cache"] for r in needles] == ["default", "quant-4bit", "quant-2bit"]
    assert all(r["needles"] == 4 and len(r["scores"]) == 4 for r in needles)
    assert "delta_logprob" in needles[1] and "delta_logprob" not in needles[0]
    md = out.with_suffix(".md").read_text()
    assert "| quant-2bit |" in md and "refused" in md and "### 512 tokens" in md
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert report["fidelity"][1]["cache"] == "quant-4bit"


def test_defaults_per_model_and_the_reference_always_first():
    settings, caches, needle_caches, note = fidelity.resolve_args(fidelity._parser().parse_args([]))
    smollm2 = fidelity.MODEL_DEFAULTS["smollm2-135m"]
    assert (settings.context, settings.docs, settings.lengths) == (smollm2.context, smollm2.docs, smollm2.lengths)
    assert [c.label for c in caches][0] == "default" and len(caches) == len(fidelity.DEFAULT_CACHES)
    assert needle_caches == caches and settings.dtype == "bfloat16" and settings.chunk == 256
    _, caches, needle_caches, note = fidelity.resolve_args(fidelity._parser().parse_args(
        ["--caches", "quant:4", "--needle-caches", "hf-quanto:2", "default", "--context", "4096"]))
    assert [c.label for c in caches] == ["default", "quant-4bit"]  # the reference is added, first
    assert [c.label for c in needle_caches] == ["default", "hf-quanto-2bit"]
    assert note == "set on the command line"


@pytest.mark.parametrize("argv,fidelity_caches,needle_caches", [
    (["--caches"], 0, 13), (["--lengths"], 13, 0), (["--needle-caches"], 13, 0), (["--caches", "--lengths"], 0, 0)])
def test_empty_lists_skip_a_part(argv, fidelity_caches, needle_caches):
    _, caches, needles, _ = fidelity.resolve_args(fidelity._parser().parse_args(argv))
    assert (len(caches), len(needles)) == (fidelity_caches, needle_caches)


@pytest.mark.parametrize("chunk,align", [(256, 128), (128, 128), (512, 128), (200, 200), (64, 64)])
def test_needle_fills_end_with_a_piece_that_flushes_transformers_caches(chunk, align):
    from eval.adapter import chunk_bounds

    assert fidelity.needle_align(chunk) == align
    for fill in range(align, 20 * align, align):  # the last piece reaches the 128-token residual: it re-quantizes
        start, end = chunk_bounds(fill, chunk)[-1]
        assert end - start >= min(chunk, 128)


@pytest.mark.parametrize("kind, bits, options, label", [
    ("quant", 3, {}, "quant-3bit"),
    ("quant", None, {}, "quant-4bit"),  # QuantCache's default widths
    ("quant", None, {"k_bits": "4", "v_bits": "2", "rotation": "hadamard"}, "quant-k4v2(rotation=hadamard)"),
    ("quant", None, {"k_bits": "3", "v_bits": "3"}, "quant-3bit"),
    ("quant", None, {"v_bits": 2}, "quant-k4v2"),
    ("hf-fp8", None, {}, "hf-fp8-8bit"),
    ("default", None, {}, "default"),
])
def test_cache_labels_name_the_widths(kind, bits, options, label):
    """Rows of a K/V split are labelled by both widths (they read 'quant-bit(...)' before)."""
    assert cache_label(kind, bits, **options) == label


def test_qwen_defaults_are_16k_in_fp32():
    """Qwen2.5-Coder-1.5B by short name: half its 32768 context, fp32 weights (bf16 matmuls are several times slower
    on these CPUs); --dtype still overrides."""
    settings, *_ = fidelity.resolve_args(fidelity._parser().parse_args(["--model", "qwen2.5-coder-1.5b"]))
    assert (settings.context, settings.docs, settings.lengths, settings.dtype) == (16384, 1, (4096, 8192, 16384),
                                                                                    "float32")
    settings, *_ = fidelity.resolve_args(fidelity._parser().parse_args(["--model", "qwen2.5-coder-1.5b",
                                                                        "--dtype", "bfloat16"]))
    assert settings.dtype == "bfloat16"
    settings, *_ = fidelity.resolve_args(fidelity._parser().parse_args([]))
    assert settings.dtype == "bfloat16"  # SmolLM2
