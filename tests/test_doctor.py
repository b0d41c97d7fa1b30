"""python -m eval.doctor on a tiny random Llama saved here (a byte tokenizer that keeps " x" whole, 512 tokens):
the report's structure, that its numbers are those of the runs it reuses (qcache.tools.size's formula, eval.fidelity's
rows), that the choice follows the needle intervals, the fp32-accumulation probe (it fails a bf16 running sum), and
clear errors."""

import json
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

pytest.importorskip("lm_eval")

from eval import doctor  # noqa: E402
from qcache.attention import fp32_sdpa_attention_forward  # noqa: E402
from qcache.tools.size import Geometry, cache_bytes  # noqa: E402
CONTEXT = 512


def space_letter_tokenizer():
    """Bytes as tokens, except that a space and the letter after it are one token (" p" in " pineapple"): words then
    start with distinct tokens by their first letter, as the needles' word values need. <s> 282, <pad> 283."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # 256 byte symbols
    space = "\u0120"  # ByteLevel's symbol for the space byte
    merges = [(space, letter) for letter in "abcdefghijklmnopqrstuvwxyz"]
    vocab.update({a + b: 256 + i for i, (a, b) in enumerate(merges)})
    vocab.update({"<s>": 282, "<pad>": 283})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 2-layer GQA Llama (random weights large enough that 2-bit caches change its predictions) + byte tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=284, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         initializer_range=0.2, pad_token_id=283, bos_token_id=282, eos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(path)
    space_letter_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def run(model_dir, tmp_path_factory):
    """One doctor run: 2 documents, 4 needles, a budget that fits the 2- and 3-bit caches only."""
    threads = torch.get_num_threads()  # main() sets its --threads (default 1) process-wide: put it back after
    out = tmp_path_factory.mktemp("doctor") / "report"
    geometry = Geometry(layers=2, kv_heads=2, head_dim=16)
    budget = sum(cache_bytes(geometry, "qcache-3bit", CONTEXT)) / 1024**3 * 1.001  # just above the 3-bit cache
    report = doctor.main(["--model", str(model_dir), "--context", str(CONTEXT), "--docs", "2", "--needles", "4",
                          "--chunk", "64", "--dtype", "float32", "--budget-gib", repr(budget), "--out", str(out),
                          "--no-progress"])
    yield report, out, budget
    torch.set_num_threads(threads)


def rows_by_setting(report):
    return {r["setting"]: r for r in report["rows"]}


def test_report_has_every_section_and_writes_its_files(run):
    report, out, _ = run
    assert [r["setting"] for r in report["rows"]] == ["default", "quant-8bit", "quant-4bit", "quant-3bit", "quant-2bit"]
    assert set(report) >= {"command", "settings", "geometry", "attention", "size", "rows", "choice", "fidelity",
                           "needles", "timings"}
    assert report["command"].startswith("python -m eval.doctor --model")
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["rows"] == json.loads(json.dumps(report["rows"]))
    md = out.with_suffix(".md").read_text()
    for heading in ("## Memory", "## Attention", f"## Quality at {CONTEXT} tokens",
                    "## Smallest setting that keeps the needles"):
        assert heading in md
    assert "| quant-2bit |" in md
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize("setting,fmt", [("default", "16-bit"), ("quant-8bit", "qcache-8bit"),
                                         ("quant-4bit", "qcache-4bit"), ("quant-3bit", "qcache-3bit"),
                                         ("quant-2bit", "qcache-2bit")])
def test_memory_is_the_sizing_formula(run, setting, fmt):
    report, _, budget = run
    row = rows_by_setting(report)[setting]
    held = sum(cache_bytes(Geometry(layers=2, kv_heads=2, head_dim=16), fmt, CONTEXT))
    assert row["bytes_per_token"] == pytest.approx(held / CONTEXT)
    assert row["gib_at_context"] == pytest.approx(held / 1024**3)
    assert row["fits_budget"] == (held / 1024**3 <= budget)
    assert row["requests_that_fit"] == int(budget * 1024**3 // held)


def test_budget_splits_the_widths(run):
    rows = rows_by_setting(run[0])
    assert [rows[s]["fits_budget"] for s in ("default", "quant-8bit", "quant-4bit", "quant-3bit", "quant-2bit")] == [
        False, False, False, True, True]


@pytest.mark.parametrize("setting", ["quant-8bit", "quant-4bit", "quant-3bit", "quant-2bit"])
def test_quality_numbers_are_the_fidelity_runs(run, setting):
    report, _, _ = run
    row = rows_by_setting(report)[setting]
    fid = next(r for r in report["fidelity"] if r["cache"] == setting)
    needles = next(r for r in report["needles"] if r["cache"] == setting)
    assert (row["kl"], row["top1"], row["delta_ppl_pct"]) == (fid["kl"], fid["top1"], fid["delta_ppl_pct"])
    assert row["bits_per_value"] == fid["bits_per_value"]
    assert row["held_bytes_per_token"] == fid["held_bytes"][-1] / CONTEXT
    assert (row["needles"]["found"], row["needles"]["needles"]) == (needles["found"], 4)
    assert row["needles"]["min_margin_mean"] == pytest.approx(
        sum(s["min_margin"] for s in needles["scores"]) / 4)


def test_more_bits_diverge_less_and_hold_more(run):
    rows = rows_by_setting(run[0])
    assert 0 < rows["quant-8bit"]["kl"] < rows["quant-2bit"]["kl"]
    assert rows["quant-8bit"]["top1"] >= rows["quant-2bit"]["top1"]
    assert rows["quant-2bit"]["bits_per_value"] < rows["quant-4bit"]["bits_per_value"] < rows["quant-8bit"][
        "bits_per_value"] < rows["default"]["bits_per_value"]


def test_choice_follows_the_needle_intervals(run):
    report = run[0]
    rows = rows_by_setting(report)
    lo = rows["default"]["needles"]["wilson95"][0]
    choice = report["choice"]
    for setting, row in rows.items():
        if setting != "default":
            assert row["keeps_needles"] == (row["needles"]["share"] >= lo)
    assert choice == doctor.choose_setting(report["rows"])
    keeping = [s for s in ("quant-2bit", "quant-3bit", "quant-4bit", "quant-8bit") if rows[s]["keeps_needles"]]
    assert choice["setting"] == (keeping[0] if keeping else None)
    if choice["setting"] is not None:
        assert choice["fits_budget"] == rows[choice["setting"]]["fits_budget"]


def test_attention_section_names_the_implementation_and_probes_it(run):
    attention = run[0]["attention"]
    assert attention["implementation"] == "sdpa" and attention["model_dtype"] == "float32"
    assert attention["fp32_accumulation"].startswith("yes")  # a float32 model
    assert attention["probe"]["keys"] == CONTEXT and attention["probe"]["verdict"] == "fp32"


# ---------------------------------------------------------------------------------------------------------------
# the choice, on constructed rows
# ---------------------------------------------------------------------------------------------------------------


def _rows(ref_wilson, shares):
    rows = [{"setting": "default", "bytes_per_token": 100.0, "needles": {"share": 1.0, "wilson95": ref_wilson}}]
    for bits, share in shares.items():
        row = {"setting": f"quant-{bits}bit", "bytes_per_token": float(bits), "needles": {"share": share}}
        row["keeps_needles"] = doctor.keeps_needles(row["needles"], {"wilson95": ref_wilson})
        rows.append(row)
    return rows


@pytest.mark.parametrize("shares,expected,note", [
    ({8: 1.0, 4: 1.0, 3: 0.9, 2: 0.5}, "quant-3bit", False),
    ({8: 1.0, 4: 0.95, 3: 0.5, 2: 0.2}, "quant-4bit", False),
    ({8: 0.5, 4: 0.4, 3: 0.2, 2: 0.0}, None, False),
    ({8: 0.5, 4: 1.0, 3: 0.2, 2: 0.0}, "quant-4bit", True),  # 8-bit failing while 4-bit keeps: flagged as noise
    ({8: 1.0, 4: 1.0, 3: 1.0, 2: 0.9}, "quant-2bit", False),
])
def test_choose_setting_takes_the_fewest_bytes_that_keep_the_needles(shares, expected, note):
    choice = doctor.choose_setting(_rows([0.886, 1.0], shares))
    assert choice["setting"] == expected
    assert ("note" in choice) == note


def test_choose_setting_says_when_the_default_finds_no_needle():
    rows = _rows([0.0, 0.49], {8: 0.0, 4: 0.0, 2: 0.0})
    rows[0]["needles"]["share"] = 0.0
    choice = doctor.choose_setting(rows)
    assert choice["setting"] == "quant-2bit" and "finds none of the needles" in choice["note"]


def test_choose_setting_needs_the_reference():
    with pytest.raises(ValueError, match="default cache's needle row"):
        doctor.choose_setting([{"setting": "quant-4bit", "bytes_per_token": 1.0, "keeps_needles": True}])


# ---------------------------------------------------------------------------------------------------------------
# the fp32 probe
# ---------------------------------------------------------------------------------------------------------------


class _Module(torch.nn.Module):
    def __init__(self, groups=2):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def bf16_running_sum_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention whose P @ V adds one key at a time in bf16 (what the probe must catch)."""
    key = key.repeat_interleave(module.num_key_value_groups, dim=1)  # [B, Hq, n, D]
    value = value.repeat_interleave(module.num_key_value_groups, dim=1)
    probs = torch.softmax(query.float() @ key.float().transpose(-1, -2) * scaling, dim=-1).to(query.dtype)  # [B,Hq,1,n]
    out = torch.zeros_like(query)  # [B, Hq, 1, D]
    for j in range(value.shape[2]):
        out = out + probs[..., j:j + 1] * value[:, :, j:j + 1]  # rounded to bf16 after every addition
    return out.transpose(1, 2), None  # [B, 1, Hq, D]


@pytest.mark.parametrize("name", ["sdpa", "qcache_fp32"])
def test_probe_passes_fp32_accumulating_attention(name):
    fn = fp32_sdpa_attention_forward if name == "qcache_fp32" else ALL_ATTENTION_FUNCTIONS["sdpa"]
    probe = doctor.probe_accumulation(fn, _Module(), 4096, torch.bfloat16, q_heads=4, kv_heads=2, head_dim=64)
    assert probe["verdict"] == "fp32" and probe["max_rel_error"] <= probe["tolerance"] < 0.01


def test_probe_catches_a_bf16_running_sum():
    probe = doctor.probe_accumulation(bf16_running_sum_attention, _Module(), 1024, torch.bfloat16, 4, 2, 64)
    assert probe["verdict"] == "low precision" and probe["max_rel_error"] > 0.5  # 256 of 1024 terms counted


def test_probe_cannot_tell_below_the_stall_length():
    probe = doctor.probe_accumulation(fp32_sdpa_attention_forward, _Module(), 128, torch.bfloat16, 4, 2, 64)
    assert probe["verdict"] == "undetermined"


# ---------------------------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--context", "0"], "context=0 must be a positive integer"),
    (["--context", "2048"], "context=2048 exceeds the model's max_position_embeddings=1024"),
    (["--budget-gib", "-1"], "budget_gib=-1.0 must be a positive number"),
    (["--bits", "5"], r"argument --bits: invalid choice: 5"),
    (["--bits", "4", "4"], r"bits=\[4, 4\] repeats a width"),
    (["--docs", "0"], "docs=0 must be a positive integer"),
    (["--needles", "0"], "needles=0 must be a positive integer"),
    (["--chunk", "0"], "chunk=0 must be a positive integer"),
    (["--attn-implementation", "flash"], "invalid choice: 'flash'"),
    (["--threads", "0"], "threads=0 must be a positive integer"),
    (["--context", "256", "--chunk", "64", "--needles", "20"], "too short for 20 needles"),
])
def test_bad_arguments_are_refused_by_name(model_dir, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        doctor.main(["--model", str(model_dir), "--no-progress", "--out", "/nonexistent/never-written", *argv])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("model,message", [("/nowhere/model", "does not exist"),
                                           ("not-a-model", "not a known short name")])
def test_unknown_models_are_refused(model, message, capsys):
    with pytest.raises(SystemExit):
        doctor.main(["--model", model, "--context", "512"])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,message", [({"bits": ()}, "measures nothing"), ({"dtype": "int8"}, "dtype='int8'"),
                                            ({"attn_implementation": "flash"}, "'flash' is not supported")])
def test_settings_validate(kwargs, message):
    with pytest.raises(ValueError, match=message):
        doctor.DoctorSettings(context=512, **kwargs)


@pytest.mark.parametrize("blocked, modules", [
    (["lm_eval", "matplotlib"], ["eval.doctor"]),  # the doctor loads lm-eval and matplotlib only when it runs them
    (["lm_eval", "matplotlib", "eval", "calibration"], ["qcache", "qcache.tools.size"]),  # the runtime and sizing
])
def test_imports_without_what_it_does_not_need(blocked, modules):
    import subprocess
    import sys

    code = ("import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in blocked)
            + "".join(f"import {name}\n" for name in modules) + "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
