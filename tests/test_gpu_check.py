"""bench/gpu_check.py --cpu-smoke: every section that does not need CUDA runs on tiny random models (so the GPU
script does not rot between GPU runs), CUDA-only parts are skipped with their reason, a failing or hanging section
is recorded and the next one still runs, and bad arguments are refused."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("optimum.quanto")

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


SECTIONS = ["prepare", "env", "paths/tiny-llama", "paths/tiny-gemma3", "decode/tiny-llama/256",
            "decode/tiny-gemma3/256", "decode/tiny-gemma3/512"]


@pytest.mark.parametrize("name", SECTIONS)
def test_every_cpu_section_runs(smoke, name):
    record = smoke[0]["sections"][name]
    assert record["status"] == "ok", record.get("error") or record.get("traceback")
    assert record["seconds"] < record["budget_s"]


def test_cuda_only_parts_are_skipped_with_the_reason(smoke):
    report, md = smoke
    assert report["sections"]["device_map/tiny-llama"] == {
        "status": "skipped", "budget_s": 30, "rows": [], "reason": "CUDA only: skipped by --cpu-smoke"}
    for name in ("paths/tiny-llama", "paths/tiny-gemma3"):
        result = report["sections"][name]["result"]
        assert sorted(result["skipped"]) == ["compiled", "fused"]
        assert all("CUDA only" in why for why in result["skipped"].values())
    for name in ("decode/tiny-llama/256", "decode/tiny-gemma3/512"):
        result = report["sections"][name]["result"]
        assert "CUDA only" in result["memory_skipped"]
        assert all("held_allocated" not in r and "peak_decode" not in r for r in result["rows"])
    assert "| device_map/tiny-llama | skipped |" in md and "## Decode and memory: tiny-gemma3 at 512 tokens" in md


@pytest.mark.parametrize("name", ["paths/tiny-llama", "paths/tiny-gemma3"])
def test_paths_compare_reads_of_the_same_codes_and_end_to_end_tokens(smoke, name):
    result = smoke[0]["sections"][name]["result"]
    same = {r["path"]: r for r in result["same_codes"]}
    assert sorted(same) == ["eager", "eager@fp32"]
    for row in same.values():  # the same codes read twice by the eager path: identical
        assert row["read_max_rel_diff"] == 0.0 and row["reads_agree"] and row["step_argmax_equal"]
        assert row["logits_scale"] > 0
    ends = {r["path"]: r for r in result["end_to_end"]}
    assert len(ends["eager"]["tokens"]) == result["decode_steps"]
    assert ends["eager@fp32"]["reference"] == "eager" and isinstance(ends["eager@fp32"]["tokens_equal"], bool)


@pytest.mark.parametrize("name,rows", [
    ("decode/tiny-llama/256", ["default", "default@fp32", "quant-4bit", "quant-4bit+eager", "quant-4bit@fp32",
                               "hf-quanto-4bit"]),
    ("decode/tiny-gemma3/256", ["default", "default@fp32", "quant-4bit", "quant-4bit+eager", "quant-4bit@fp32"]),
])
def test_decode_measures_every_cache_against_the_default(smoke, name, rows):
    result = smoke[0]["sections"][name]["result"]
    measured = {r["row"]: r for r in result["rows"] if "refused" not in r}
    assert list(measured) == rows
    assert measured["default"]["vs_default"] == 1.0
    for r in measured.values():
        assert r["tokens_per_s"] > 0 and r["held_counted"] > 0
    if "hf-quanto-4bit" in measured:
        assert measured["hf-quanto-4bit"]["vs_quanto"] == 1.0
    else:  # Transformers' quantized caches refuse models with sliding-window layers
        refused = next(r for r in result["rows"] if r["row"] == "hf-quanto-4bit")
        assert "full attention" in refused["refused"]


@pytest.mark.parametrize("row", ["default", "quant-4bit", "quant-4bit+eager"])
def test_memory_matches_the_formula_on_full_attention(smoke, row):
    """tiny-llama (full attention, bf16): the default cache holds exactly the 16-bit formula; QuantCache's layout
    (memory() less reserved capacity and the RoPE helper) is exactly qcache.layout.bytes_per_token's."""
    result = smoke[0]["sections"]["decode/tiny-llama/256"]["result"]
    r = next(x for x in result["rows"] if x["row"] == row)
    assert r["layout_vs_formula"] == pytest.approx(1.0, abs=1e-12)
    assert r["held_counted"] >= r["counted_layout"]


def test_a_failing_and_a_hanging_section_are_recorded_and_the_rest_runs(tmp_path):
    report, md = _run(tmp_path, "--sections", "prepare", "env", "decode/tiny-llama/256", "--inject-hang", "prepare",
                      "--section-budget", "prepare=3", "--inject-failure", "env")
    s = report["sections"]
    assert s["prepare"]["status"] == "timeout" and "budget of 3 s" in s["prepare"]["error"]
    assert s["env"]["status"] == "error" and "injected failure in env" in s["env"]["error"]
    assert "RuntimeError" in s["env"]["traceback"]
    assert s["decode/tiny-llama/256"]["status"] == "ok"
    assert list(s) == ["prepare", "env", "decode/tiny-llama/256"]
    assert "| prepare | timeout |" in md and "| env | error |" in md


@pytest.mark.parametrize("argv,message", [
    (["--cpu-smoke", "--sections", "decode/nope"], "unknown sections ['decode/nope']"),
    (["--cpu-smoke", "--section-budget", "env=-1"], "seconds must be positive"),
    (["--cpu-smoke", "--section-budget", "nope=3"], "'nope' is not a section"),
    (["--cpu-smoke", "--section-budget", "env=soon"], "'soon' is not a number of seconds"),
    (["--cpu-smoke", "--inject-failure", "nope"], "--inject-failure 'nope': not a section"),
    (["--cpu-smoke", "--paths", "turbo"], "invalid choice: 'turbo'"),
    (["--cpu-smoke", "--threads", "0"], "--threads 0 must be a positive integer"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _module().main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_full_check_says_so(capsys):
    with pytest.raises(SystemExit):
        _module().main([])
    assert "no CUDA device here" in capsys.readouterr().err
