"""bench/gpu_check.py --cpu-smoke: every section runs on tiny random models of the GPU check's families (so the GPU
script does not rot between GPU runs), CUDA-only parts are skipped with their reason, a failing or hanging section
is recorded and the next one still runs, a row that would not fit in memory is skipped with its estimate, a killed
run leaves its partial report, and bad arguments are refused."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, *args):
    out = tmp_path / "check"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.with_suffix(".json").read_text()), out.with_suffix(".md").read_text()


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("gpu-check"))


SECTIONS = ["env", "paths/tiny-qwen2/8bit", "paths/tiny-qwen2/4bit"] + [
    f"decode/{m}/{L}/b{b}" for m in ("tiny-qwen2", "tiny-llama3") for L in (384, 640) for b in (1, 8)]
DECODES = [s for s in SECTIONS if s.startswith("decode/")]


def test_the_plan_mirrors_the_cuda_run():
    module = _module()
    assert [s.name for s in module.plan(smoke=True)] == SECTIONS
    cuda = [s.name for s in module.plan(smoke=False)]
    assert cuda[:3] == ["env", "paths/qwen2.5-1.5b/8bit", "paths/qwen2.5-1.5b/4bit"]
    assert {s for s in cuda if s.startswith("decode/")} == {
        f"decode/{m}/{L}/b{b}" for m in ("qwen2.5-1.5b", "llama3.1-8b") for L in (8192, 32768) for b in (1, 8)}
    assert sum(s.budget_s for s in module.plan(smoke=False)) >= module.TOTAL_BUDGET_S  # the total is what binds


@pytest.mark.parametrize("name,geometry", [
    ("qwen2.5-1.5b", (28, 1536, 8960, 12, 2, 128, 151936, True)),
    ("llama3.1-8b", (32, 4096, 14336, 32, 8, 128, 128256, False)),
])
def test_model_configs_have_the_real_geometry(name, geometry):
    c = _module().model_config(name)
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.tie_word_embeddings) == geometry
    if name.startswith("llama"):
        assert c.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
    else:
        assert c.rope_parameters["rope_theta"] == 1e6 and c.max_position_embeddings == 32768


@pytest.mark.parametrize("name", SECTIONS)
def test_every_section_runs(smoke, name):
    record = smoke[0]["sections"][name]
    assert record["status"] == "ok", record.get("error") or record.get("traceback")
    assert record["seconds"] < record["budget_s"]


def test_the_report_is_finished_and_lists_every_section(smoke):
    report, md = smoke
    assert report["finished"] and list(report["sections"]) == SECTIONS
    for name in SECTIONS:
        assert f"| {name} | ok |" in md
    assert "## Decode: tiny-llama3, 640 tokens, batch 8" in md and "## Summary" in md


def test_cuda_only_parts_are_skipped_with_the_reason(smoke):
    report, _ = smoke
    env = report["sections"]["env"]["result"]
    assert "CUDA only" in env["copy_bandwidth"]["skipped"]
    for name in ("paths/tiny-qwen2/8bit", "paths/tiny-qwen2/4bit"):
        result = report["sections"][name]["result"]
        assert sorted(result["skipped"]) == ["compiled", "compiled@fp32"]
        assert all("CUDA only" in why for why in result["skipped"].values())
    for name in DECODES:
        result = report["sections"][name]["result"]
        assert "CUDA only" in result["memory_skipped"]
        rows = {r["row"]: r for r in result["rows"]}
        assert all("held_allocated" not in r and "peak_decode" not in r for r in rows.values())
        assert "not installed" in rows["default@flash_attention_2"]["skipped"]
        assert "CUDA only" in rows["quant-4bit"]["fused_attention_skipped"]


@pytest.mark.parametrize("name", ["paths/tiny-qwen2/8bit", "paths/tiny-qwen2/4bit"])
def test_paths_compare_reads_of_the_same_codes_and_end_to_end_tokens(smoke, name):
    result = smoke[0]["sections"][name]["result"]
    assert result["bits"] == int(name.split("/")[-1][0])
    same = {r["path"]: r for r in result["same_codes"]}
    assert sorted(same) == ["eager", "eager@fp32"]
    for row in same.values():  # the same codes read twice by the eager path: identical
        assert row["read_max_rel_diff"] == 0.0 and row["reads_agree"] and row["step_argmax_equal"]
        assert row["logits_scale"] > 0 and row["logits_agree"]
    ends = {r["path"]: r for r in result["end_to_end"]}
    assert len(ends["eager"]["tokens"]) == result["decode_steps"]
    fp32 = ends["eager@fp32"]
    assert fp32["reference"] == "eager" and isinstance(fp32["tokens_equal"], bool)
    assert 0 <= fp32["tokens_agree_for"] <= result["decode_steps"] and math.isfinite(fp32["logits_max_abs_diff"])


@pytest.mark.parametrize("name", DECODES)
def test_decode_measures_every_cache_against_the_default(smoke, name):
    result = smoke[0]["sections"][name]["result"]
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["default", "default@flash_attention_2", "quant-4bit", "hf-quanto-4bit"]
    assert result["batch"] == int(name.split("/b")[-1]) and result["context"] == int(name.split("/")[2])
    for r in rows.values():  # every row is measured or says why not
        assert ("tokens_per_s" in r) != ("skipped" in r), r
        assert "skipped" not in r or r["skipped"]
    assert rows["default"]["vs_default"] == 1.0
    measured = [r for r in rows.values() if "tokens_per_s" in r]
    assert {"default", "quant-4bit"} <= {r["row"] for r in measured}
    for r in measured:
        for key in ("tokens_per_s", "vs_default", "step_s_median", "held_counted", "step_bytes_per_s",
                    "memory_vs_default"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["row"], key, r[key])
        assert r["step_s_min"] <= r["step_s_median"] <= r["step_s_max"]
    quant = rows["quant-4bit"]
    assert quant["kernel"] == "eager" and quant["decode_kernel"] is None  # the smoke run reads eagerly
    if "skipped" in rows["hf-quanto-4bit"]:  # not importable, or its extension not built yet
        assert "optimum-quanto" in rows["hf-quanto-4bit"]["skipped"]


@pytest.mark.parametrize("name", [s for s in DECODES if "/640/" in s])
def test_memory_matches_the_formula(smoke, name):
    """Full attention, bf16: the default cache holds exactly the 16-bit formula; QuantCache's layout (memory() less
    reserved capacity, the RoPE helper and constants) is exactly qcache.layout.bytes_per_token's, times the batch;
    and at 640 tokens part of it is quantized, so it holds less."""
    rows = {r["row"]: r for r in smoke[0]["sections"][name]["result"]["rows"]}
    for row in ("default", "quant-4bit"):
        assert rows[row]["layout_vs_formula"] == pytest.approx(1.0, abs=1e-12)
        assert rows[row]["held_counted"] >= rows[row]["counted_layout"]
    assert rows["quant-4bit"]["memory_vs_default"] < 0.6


def test_a_failing_and_a_hanging_section_are_recorded_and_the_rest_runs(tmp_path):
    report, md = _run(tmp_path, "--sections", "env", "paths/tiny-qwen2/4bit", "decode/tiny-qwen2/384/b8",
                      "--inject-hang", "env", "--section-budget", "env=3", "--inject-failure", "paths/tiny-qwen2/4bit",
                      "--memory-limit-gib", "0.0001")
    s = report["sections"]
    assert s["env"]["status"] == "timeout" and "budget of 3 s" in s["env"]["error"]
    assert s["paths/tiny-qwen2/4bit"]["status"] == "error"
    assert "injected failure in paths/tiny-qwen2/4bit" in s["paths/tiny-qwen2/4bit"]["error"]
    assert "RuntimeError" in s["paths/tiny-qwen2/4bit"]["traceback"]
    decode = s["decode/tiny-qwen2/384/b8"]
    assert decode["status"] == "ok"
    assert list(s) == ["env", "paths/tiny-qwen2/4bit", "decode/tiny-qwen2/384/b8"]
    assert "| env | timeout |" in md and "| paths/tiny-qwen2/4bit | error |" in md
    for row in decode["result"]["rows"]:  # 0.1 MiB holds no cache: each row says what it would need
        if row["row"] in ("default", "quant-4bit"):
            assert row["skipped"].startswith("memory: needs about") and "GiB free" in row["skipped"]
            assert row["memory_estimate"] > 0


def test_a_killed_run_leaves_its_partial_report(tmp_path):
    out = tmp_path / "partial"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), "--sections", "env",
                             "decode/tiny-qwen2/384/b1", "--inject-hang", "decode/tiny-qwen2/384/b1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, report = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            try:
                report = json.loads(out.with_suffix(".json").read_text())
            except (OSError, ValueError):
                report = None
            if report and report["sections"]["decode/tiny-qwen2/384/b1"]["status"] == "running":
                break
            time.sleep(0.3)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the parent and its child, as a device-tool timeout would
        proc.wait()
    assert report is not None and not report["finished"]
    assert report["sections"]["env"]["status"] == "ok" and report["sections"]["env"]["result"]["torch"]
    assert "still running (partial)" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("argv,message", [
    (["--cpu-smoke", "--sections", "decode/nope"], "unknown sections ['decode/nope']"),
    (["--cpu-smoke", "--section-budget", "env=-1"], "seconds must be positive"),
    (["--cpu-smoke", "--section-budget", "nope=3"], "'nope' is not a section"),
    (["--cpu-smoke", "--section-budget", "env=soon"], "'soon' is not a number of seconds"),
    (["--cpu-smoke", "--inject-failure", "nope"], "--inject-failure 'nope': not a section"),
    (["--cpu-smoke", "--paths", "turbo"], "invalid choice: 'turbo'"),
    (["--cpu-smoke", "--threads", "0"], "--threads 0 must be a positive integer"),
    (["--cpu-smoke", "--memory-limit-gib", "0"], "--memory-limit-gib 0.0 must be a positive number of GiB"),
    (["--cpu-smoke", "--total-budget", "-5"], "--total-budget -5.0 must be a positive number of seconds"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _module().main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_an_unknown_model_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"model 'gpt-9' is not known; allowed: \['qwen2.5-1.5b', 'llama3.1-8b'"):
        _module().model_config("gpt-9")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_full_check_says_so(capsys):
    with pytest.raises(SystemExit):
        _module().main([])
    assert "no CUDA device here" in capsys.readouterr().err


def test_the_device_runner_installs_the_carried_wheels_offline_and_writes_under_out():
    text = (SCRIPT.parent / "gpu_run.sh").read_text()
    assert "pip install -q --no-index --no-deps" in text and ".gpu-wheels" in text
    assert 'bench/gpu_check.py --out "$out_dir/gpu-check"' in text and "${OUT:-docs/results}" in text
    assert subprocess.run(["bash", "-n", str(SCRIPT.parent / "gpu_run.sh")]).returncode == 0
