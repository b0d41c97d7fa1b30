"""A quantized cache saved, loaded and forked: it continues exactly as the original would have, and every bad file is
refused with a clear error."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_model
from qcache import QuantCache
from qcache.presets import recipe

OPTS = dict(k_group_size=16, recent_tokens=4, sink_tokens=2, kernel="eager")
SETUPS = {  # family, options: the defaults (rotation, rotate="auto", norm values, 8-bit window), and Gemma's
    # layer kinds (a native sliding layer, a token-window sliding layer), and a calibration-free 2-bit row
    "llama-defaults": ("llama", {}),
    "gemma3-native": ("gemma3", {}),
    "gemma3-tokens": ("gemma3", {"sliding_layers": "tokens", "sliding_bits": 4}),
    "qwen3-2bit": ("qwen3", {"bits": 2}),
}


def ids(n, seed):
    return torch.randint(2, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def run(model, cache, tokens, start):
    """Logits of `tokens` fed one by one from position `start` (decode steps)."""
    out = []
    with torch.no_grad():
        for j in range(tokens.shape[1]):
            out.append(model(tokens[:, j:j + 1], past_key_values=cache, use_cache=True,
                             position_ids=torch.tensor([[start + j]])).logits)
    return torch.cat(out, dim=1)


def prefilled(family, options, n=70):
    model = make_model(family)
    cache = QuantCache(model.config, **OPTS, **options)
    with torch.no_grad():
        model(ids(n, 1), past_key_values=cache, use_cache=True)
    return model, cache


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_save_load_continue_equals_continue(setup, tmp_path):
    family, options = SETUPS[setup]
    model, cache = prefilled(family, options)
    path = cache.save(tmp_path / "prefix.safetensors")
    loaded = QuantCache.load(path, model)
    assert loaded.get_seq_length() == cache.get_seq_length() == 70
    assert loaded.key_rotation == cache.key_rotation
    more = ids(20, 2)  # crosses a key block flush
    ref, got = run(model, cache, more, 70), run(model, loaded, more, 70)
    assert torch.equal(ref, got)
    mem, held = cache.memory(), loaded.memory()
    assert mem.total - mem.reserved == held.total - held.reserved


def test_a_short_prefix_held_as_given_round_trips(tmp_path):
    """A prefix shorter than its first key block is held as given ("early"): the file keeps those tokens as they are,
    and the loaded cache continues bit for bit, through the point where they take their window codes."""
    model = make_model("llama")
    cache = QuantCache(model.config, kernel="eager", k_group_size=16, recent_tokens=8, sink_tokens=2)
    with torch.no_grad():
        model(ids(20, 1), past_key_values=cache, use_cache=True)
    assert cache.layers[0].store.length("early") == 18 and cache.layers[0].quantized_length == 0
    loaded = QuantCache.load(cache.save(tmp_path / "short.safetensors"), model)
    assert torch.equal(loaded.layers[0].store.view("early_k"), cache.layers[0].store.view("early_k"))
    more = ids(12, 2)  # 2 + 8 + 16 = 26 tokens make the first block due
    assert torch.equal(run(model, cache, more, 20), run(model, loaded, more, 20))
    assert loaded.layers[0].store.length("early") == 0 and loaded.layers[0].quantized_length == 16


def test_a_calibrated_cache_round_trips(tmp_path):
    """The calibrated levels the layers read travel in the file: the loaded cache needs no calibration file."""
    from qcache.calibfile import CalibrationData, model_fingerprint

    model = make_model("llama")
    fp = model_fingerprint(model.config)
    cb = torch.linspace(-1, 1, 16)
    options = recipe(bits=4, rotation="none", rotate="kv", v_scale="minmax", window_bits=16, **OPTS)
    calibration = CalibrationData(fp, options.to_dict(), {}, {i: {"k_codebook": cb, "v_codebook": cb.flip(0).neg()}
                                                              for i in range(2)})
    cache = QuantCache(model.config, calibration=calibration)
    with torch.no_grad():
        model(ids(70, 1), past_key_values=cache, use_cache=True)
    assert cache.layers[0].k_codec.codebook
    loaded = QuantCache.load(cache.save(tmp_path / "c.safetensors"), model)
    assert loaded.layers[0].k_codec.codebook and loaded.layers[0].v_codec.codebook
    more = ids(20, 2)
    assert torch.equal(run(model, cache, more, 70), run(model, loaded, more, 70))


def test_fork_isolation():
    """Two continuations of one prefix: each equals the same continuation of its own freshly prefilled cache, and
    neither sees the other's tokens."""
    model, cache = prefilled("llama", {})
    fork = cache.fork()
    a, b = ids(20, 3), ids(20, 4)
    got_b = run(model, fork, b, 70)
    got_a = run(model, cache, a, 70)
    _, fresh_a = prefilled("llama", {})
    _, fresh_b = prefilled("llama", {})
    assert torch.equal(got_a, run(model, fresh_a, a, 70)) and torch.equal(got_b, run(model, fresh_b, b, 70))
    assert cache.get_seq_length() == fork.get_seq_length() == 90
    assert cache.layers[0].store is not fork.layers[0].store


def test_fork_of_a_gemma_cache_keeps_its_native_layers_apart():
    model, cache = prefilled("gemma3", {})
    fork = cache.fork()
    run(model, fork, ids(5, 3), 70)
    assert fork.layers[0].keys is not cache.layers[0].keys and cache.layers[0].cumulative_length == 70
    assert fork.layers[0].cumulative_length == 75


def _resave(src, dst, change):
    """Copy a saved cache with `change(tensors, metadata)` applied."""
    with safe_open(str(src), framework="pt") as f:
        metadata, tensors = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    change(tensors, metadata)
    save_file(tensors, str(dst), metadata=metadata)
    return dst


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, cache = prefilled("llama", {})
    return model, cache.save(tmp_path_factory.mktemp("saved") / "prefix.safetensors")


def test_a_truncated_file_is_refused(saved, tmp_path):
    model, path = saved
    cut = tmp_path / "cut.safetensors"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable qcache cache file"):
        QuantCache.load(cut, model)


def test_another_format_is_refused(saved, tmp_path):
    model, path = saved
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other), metadata={"format_version": "3"})
    with pytest.raises(ValueError, match="has format None; QuantCache.load reads 'qcache-kv-1'"):
        QuantCache.load(other, model)
    with pytest.raises(FileNotFoundError, match="no saved cache"):
        QuantCache.load(tmp_path / "missing.safetensors", model)


def test_another_model_is_refused(saved):
    _, path = saved
    with pytest.raises(ValueError, match="holds a cache of another model"):
        QuantCache.load(path, make_model("gemma3"))


def test_another_recipe_is_refused(saved):
    model, path = saved
    with pytest.raises(ValueError, match=r"another recipe \(file, asked\): \{'k_bits': \(4, 2\), 'v_bits': \(4, 2\)"):
        QuantCache.load(path, model, options=recipe(bits=2, **OPTS))
    assert QuantCache.load(path, model, options=recipe(bits=4, **OPTS)).get_seq_length() == 70


def test_nan_scales_are_refused(saved, tmp_path):
    model, path = saved

    def poison(tensors, metadata):
        name = next(n for n in tensors if "scale" in n and tensors[n].is_floating_point())
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = float("nan")

    bad = _resave(path, tmp_path / "nan.safetensors", poison)
    with pytest.raises(ValueError, match="holds NaN or infinite values"):
        QuantCache.load(bad, model)


def test_a_missing_or_misshapen_tensor_is_refused(saved, tmp_path):
    model, path = saved
    bad = _resave(path, tmp_path / "missing.safetensors", lambda t, m: t.pop("layers.1.first"))
    with pytest.raises(ValueError, match=r"tensor 'layers.1.first' is missing"):
        QuantCache.load(bad, model)

    def grow(tensors, metadata):
        layers = json.loads(metadata["layers"])
        layers[0]["lengths"]["residual"] += 1
        metadata["layers"] = json.dumps(layers)

    bad = _resave(path, tmp_path / "shape.safetensors", grow)
    with pytest.raises(ValueError, match=r"tensor 'layers.0.store.wk_codes' has shape"):
        QuantCache.load(bad, model)


def test_save_refuses_an_unbound_cache(tmp_path):
    with pytest.raises(ValueError, match="prefill it before save"):
        QuantCache(bits=4).save(tmp_path / "x.safetensors")


def test_generate_from_a_loaded_prefix(tmp_path):
    """The README's example: generate over document + question from a fork of the loaded cache gives the tokens the
    original cache gives, and the loaded cache itself stays at the document."""
    model, cache = prefilled("llama", {})
    loaded = QuantCache.load(cache.save(tmp_path / "doc.safetensors"), model)
    full = torch.cat([ids(70, 1), ids(6, 5)], dim=1)  # the document, then a question
    with torch.no_grad():
        a = model.generate(full, past_key_values=cache.fork(), max_new_tokens=8, do_sample=False, pad_token_id=0)
        b = model.generate(full, past_key_values=loaded.fork(), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b) and loaded.get_seq_length() == 70
