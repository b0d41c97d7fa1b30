"""Calibration: fitting, the safetensors file (atomic, validated) and calibrated caches in generate."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from calibration import calibrate, weighted_lloyd
from calibration.fit import fit_static_key_range
from conftest import make_model
from qcache.presets import recipe
from qcache import QuantCache
from qcache.calibfile import load_calibration, save_calibration
from qcache.cache import QuantLayer

# the calibrated path: unrotated, so the file's codebooks are used (the defaults rotate values and leave them out)
OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2, rotation="none", rotate="kv")


def calibration_ids(n=4, length=64, seed=3):
    return torch.randint(2, 96, (n, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    return make_model("llama")


@pytest.fixture(scope="module")
def llama_file(llama, tmp_path_factory):
    options = recipe(bits=2, levels="uniform", codebooks=True, **OPTS)  # uniform levels: the file holds codebooks
    data = calibrate(llama, calibration_ids(), options, {"data_source": "random ids"}, progress=False)
    return save_calibration(tmp_path_factory.mktemp("calib") / "llama.qcache.safetensors", data)


def test_weighted_lloyd_beats_uniform_on_a_bell_curve():
    u = (torch.randn(20000, generator=torch.Generator().manual_seed(0)) * 0.12 + 0.5).clamp(0, 1)
    w = torch.ones_like(u)
    levels = weighted_lloyd(u, w, 4)
    assert levels[0] == 0 and levels[-1] == 1 and bool((levels.diff() > 0).all())

    def mse(c):
        return float(((u[:, None] - c[None]).abs().min(1).values ** 2).mean())

    assert mse(levels) < 0.7 * mse(torch.linspace(0, 1, 4))


def test_static_key_range_clips_outliers():
    keys = torch.randn(1, 4000, 2)
    keys[0, 0, 0] = 50.0  # a single outlier in channel 0
    zero, rng = fit_static_key_range(keys, bits=2)
    assert float(zero[0, 0] + rng[0, 0]) < 10.0  # clipped rather than stretched to 50
    assert rng.shape == (1, 2)


def test_round_trip(llama_file, llama):
    data = load_calibration(llama_file)
    assert sorted(data.layers) == [0, 1]
    assert data.layer(0)["k_codebook"].numel() == 4 and data.layer(0)["v_codebook"].numel() == 4
    assert data.settings["data_source"] == "random ids" and data.settings["tokens"] == 4 * 64
    assert data.options["k_bits"] == 2
    assert data.model["model_type"] == "llama" and data.model["head_dim"] == 32
    tensors = load_file(llama_file)
    for name, tensor in tensors.items():
        if name in data.kv_ranges:  # file-level K/V ranges: [layers, kv heads]
            assert tensor.shape == (2, 2) and torch.equal(data.kv_ranges[name], tensor)
            continue
        idx, key = int(name.split(".")[1]), name.split(".")[2]
        assert torch.equal(data.layer(idx)[key], tensor)


def test_same_inputs_and_seed_give_the_same_tensors(llama, llama_file, tmp_path):
    again = calibrate(llama, calibration_ids(), recipe(bits=2, **OPTS), {"data_source": "random ids"},
                      progress=False)
    path = save_calibration(tmp_path / "again.safetensors", again)
    a, b = load_file(llama_file), load_file(path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_calibrated_cache_uses_the_file(llama, llama_file):
    cache = QuantCache.from_calibration(llama_file)
    assert cache.options.k_bits == 2 and cache.options.k_group_size == 16
    ids = calibration_ids(1, 60, seed=9)
    with torch.no_grad():
        out = llama.generate(ids, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 68)
    layer = cache.layers[0]
    assert isinstance(layer, QuantLayer) and layer.k_codec.codebook and layer.quantized_length > 0
    # the stored codes decode to the calibrated levels, not to uniform ones
    assert not torch.allclose(layer.consts["v"]["codebook"], torch.linspace(0, 1, 4))


def test_static_keys_quantize_on_arrival(llama, llama_file):
    cache = QuantCache(calibration=llama_file, static_keys=True)
    with torch.no_grad():
        llama(calibration_ids(1, 37, seed=4), cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.k_codec.static and layer.k_codec.group == 1
    assert layer.store.length("residual") == 4  # only the recent window stays in full precision: no partial block
    assert "k_scale" not in layer.store.parts  # no per-block key scales


def test_gemma3_calibrated_generate(tmp_path):
    model = make_model("gemma3")
    opts = recipe(bits=3, sliding_layers="quantized", **OPTS)
    data = calibrate(model, calibration_ids(), opts, {"data_source": "random ids"}, progress=False)
    assert sorted(data.layers) == [0, 1, 2]  # sliding layers are calibrated when they are quantized
    path = save_calibration(tmp_path / "g.safetensors", data)
    cache = QuantCache(calibration=path)
    with torch.no_grad():
        out = model.generate(calibration_ids(1, 50), cache=cache, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 60)
    assert all(isinstance(layer, QuantLayer) for layer in cache.layers)


def test_file_for_another_model_raises(llama_file):
    qwen = make_model("qwen3")
    with pytest.raises(ValueError, match="another model.*model_type"):
        with torch.no_grad():
            qwen(calibration_ids(1, 20), cache=QuantCache.from_calibration(llama_file), use_cache=True)
    with pytest.raises(ValueError, match="another model"):
        QuantCache(qwen.config, calibration=llama_file)


def test_truncated_file_raises(llama_file, tmp_path):
    raw = llama_file.read_bytes()
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_calibration(bad)


def test_missing_tensor_raises(llama_file, tmp_path):
    from safetensors import safe_open

    with safe_open(str(llama_file), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(llama_file)
    del tensors["layers.1.v_codebook"]
    bad = tmp_path / "missing.safetensors"
    save_file(tensors, str(bad), metadata=metadata)
    with pytest.raises(ValueError, match=r"missing tensors \['layers.1.v_codebook'\]"):
        load_calibration(bad)


def test_codebook_for_other_bits_raises(llama, llama_file):
    with pytest.raises(ValueError, match="4 levels but 4 bits need 16"):
        QuantCache(llama.config, calibration=llama_file, bits=4)


def test_not_a_qcache_file_raises(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="lacks metadata"):
        load_calibration(path)


def test_interrupted_write_leaves_nothing_that_loads(llama_file, tmp_path, monkeypatch):
    data = load_calibration(llama_file)
    target = tmp_path / "out.safetensors"

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")  # half-written temporary file
        raise KeyboardInterrupt

    monkeypatch.setattr("safetensors.torch.save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        save_calibration(target, data)
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # the temporary file was removed too


def test_cli_writes_a_loadable_file(tmp_path, monkeypatch):
    """python -m qcache.calibrate on a tiny model saved to disk, with --data text."""
    from calibration import cli

    model = make_model("llama")
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)

    class WordTokenizer:  # enough of a tokenizer for sample_sequences
        def __call__(self, text, add_special_tokens=False, return_tensors=None):
            ids = torch.tensor([[2 + hash(w) % 90 for w in text.split()]])
            return {"input_ids": ids}

    monkeypatch.setattr("qcache.tools.models.load_model", lambda name, dtype=None: (model, WordTokenizer()))
    text = tmp_path / "data.jsonl"
    text.write_text("\n".join(json.dumps({"text": " ".join(f"w{i}" for i in range(j, j + 200))}) for j in range(5)))
    out = tmp_path / "cli.safetensors"
    assert cli.main(["--model", str(model_dir), "--data", str(text), "--samples", "4", "--seq-len", "64",
                     "--bits", "3", "--rotation-len", "96", "--out", str(out)]) == 0
    data = load_calibration(out)
    assert data.options["k_bits"] == 3 and data.settings["data_source"] == str(text)
    assert data.options["outliers"] == 0  # QuantCacheConfig's default, as the cache uses it
    # a rotation and no rotate= given: the CLI measured whether keys are rotated too and stored the choice
    kls = data.settings["rotate_kl"]
    assert set(kls) == {"v", "kv", "kv+lloyd-max"}
    chosen = data.options["rotate"] + ("" if data.options["levels"] == "uniform" else "+" + data.options["levels"])
    assert kls[chosen] == min(kls.values())
    assert len(data.settings["data_sha256"]) == 64
