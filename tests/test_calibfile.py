"""Bad calibration files: each is refused by `load_calibration` with a ValueError naming the problem and what is
allowed (random bytes, truncation, NaN/inf, wrong dtypes or shapes, a codebook for other bits, another model, ...)."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from calibration import calibrate
from conftest import make_model
from qcache.presets import recipe
from qcache import QuantCacheConfig
from qcache.calibfile import FORMAT_VERSION, load_calibration, save_calibration

OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2)
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # conftest's tiny llama


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    model = make_model("llama")
    ids = torch.randint(2, 96, (2, 48), generator=torch.Generator().manual_seed(1))
    data = calibrate(model, ids, recipe(bits=2, **OPTS), {"data_source": "random ids"}, progress=False)
    return save_calibration(tmp_path_factory.mktemp("calib") / "good.safetensors", data)


def _contents(path):
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
    return load_file(path), metadata


def test_the_good_file_loads(good_file):
    data = load_calibration(good_file)
    assert sorted(data.layers) == [0, 1] and data.kv_ranges["k_absmax"].shape == (LAYERS, KV_HEADS)
    assert _contents(good_file)[1]["format_version"] == FORMAT_VERSION == "3"
    assert data.recipe == recipe(bits=2, **OPTS)  # the complete recipe it was calibrated with
    assert set(json.loads(_contents(good_file)[1]["options"])) == set(QuantCacheConfig().to_dict())


def test_format_2_options_load_as_the_behaviour_they_were_written_with(good_file, tmp_path):
    tensors, metadata = _contents(good_file)
    options = {k: v for k, v in json.loads(metadata["options"]).items() if k not in ("rotation", "rotate", "v_scale")}
    path = tmp_path / "v2.safetensors"
    save_file(tensors, str(path), metadata={**metadata, "format_version": "2", "options": json.dumps(options)})
    data = load_calibration(path)
    assert (data.recipe.rotation, data.recipe.rotate, data.recipe.v_scale) == ("none", "kv", "minmax")
    assert data.options == data.recipe.to_dict()  # normalized to the complete recipe on load


def test_format_1_file_still_loads(good_file, tmp_path):
    tensors, metadata = _contents(good_file)
    for name in ("k_absmax", "v_absmax"):
        del tensors[name]
    path = tmp_path / "v1.safetensors"
    save_file(tensors, str(path), metadata={**metadata, "format_version": "1"})
    data = load_calibration(path)
    assert data.kv_ranges is None and data.layer(1)["v_codebook"].numel() == 4


def _set(name, value):
    def edit(tensors, metadata):
        tensors[name] = value(tensors[name]) if callable(value) else value
    return edit


def _meta(key, change):
    def edit(tensors, metadata):
        metadata[key] = json.dumps(change(json.loads(metadata[key])))
    return edit


def _nan_at_0(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def _inf_at_0(t):
    t = t.clone()
    t.view(-1)[0] = float("inf")
    return t


def _drop(name):
    def edit(tensors, metadata):
        del tensors[name]
    return edit


def _format_1_with_ranges(tensors, metadata):
    metadata["format_version"] = "1"


BAD = {
    "nan-key-codebook": (_set("layers.0.k_codebook", _nan_at_0), r"layers.0.k_codebook has 1 NaN/inf values"),
    "inf-static-scale": (_set("layers.1.k_static_scale", _inf_at_0), r"k_static_scale has 1 NaN/inf values"),
    "nan-k-absmax": (_set("k_absmax", _nan_at_0), r"k_absmax has 1 NaN/inf values.*finite values only"),
    "int-codebook": (_set("layers.0.v_codebook", lambda t: (t * 3).round().int()),
                     r"v_codebook has dtype torch.int32; allowed: torch.float32"),
    "fp16-channel-weight": (_set("layers.0.k_channel_weight", lambda t: t.half()),
                            r"k_channel_weight has dtype torch.float16; allowed: torch.float32"),
    "channel-weight-shape": (_set("layers.0.k_channel_weight", torch.ones(KV_HEADS, HEAD_DIM + 1)),
                             r"k_channel_weight has shape \[2, 33\]; allowed: \[2, 32\]"),
    "codebook-2d": (_set("layers.0.k_codebook", torch.linspace(0, 1, 4).view(2, 2)),
                    r"k_codebook has shape \[2, 2\]; allowed: \[4\]"),
    "absmax-shape": (_set("v_absmax", torch.ones(LAYERS + 1, KV_HEADS)),
                     r"v_absmax has shape \[3, 2\]; allowed: \[2, 2\]"),
    "codebook-for-4-bits": (_set("layers.1.k_codebook", torch.linspace(0, 1, 16)),
                            r"16 levels \(a codebook for 4 bits\), but the file's options say k_bits=2: allowed is a "
                            r"codebook of 4 levels"),
    "codebook-outside-0-1": (_set("layers.0.v_codebook", torch.tensor([0.0, 0.4, 0.7, 1.3])),
                             r"allowed: levels sorted ascending in \[0, 1\]"),
    "codebook-unsorted": (_set("layers.0.v_codebook", torch.tensor([0.0, 0.7, 0.4, 1.0])),
                          r"allowed: levels sorted ascending in \[0, 1\]"),
    "zero-static-scale": (_set("layers.0.k_static_scale", torch.zeros(KV_HEADS, HEAD_DIM)),
                          r"k_static_scale has 64 values <= 0; allowed: scales > 0"),
    "negative-absmax": (_set("k_absmax", lambda t: -t), r"k_absmax has 4 negative values; allowed: values >= 0"),
    "unknown-layer-tensor": (_set("layers.0.k_mystery", torch.ones(2)), r"unknown tensor 'layers.0.k_mystery'"),
    "tensor-of-no-layer": (_set("layers.7.k_codebook", torch.linspace(0, 1, 4)), r"unexpected tensor 'layers.7"),
    "one-of-the-ranges": (_drop("v_absmax"), r"only \['k_absmax'\] of the K/V ranges; allowed: both"),
    "ranges-in-format-1": (_format_1_with_ranges, r"unexpected tensor 'k_absmax'"),
    "format-99": (lambda t, m: m.update(format_version="99"), r"format_version='99'; this qcache reads \['1', '2', '3'\]"),
    "bad-fingerprint": (_meta("model", lambda m: {**m, "num_key_value_heads": "two"}),
                        r"metadata 'model' num_key_value_heads='two' must be a positive integer"),
    "fingerprint-not-object": (_meta("model", lambda m: [m]), r"metadata 'model' is a list, not a JSON object"),
    "bad-options": (_meta("options", lambda o: {**o, "k_bits": 5}),
                    r"metadata 'options' are not valid.*k_bits=5 is not supported; allowed values: \[2, 3, 4, 8\]"),
    "unknown-option": (_meta("options", lambda o: {**o, "turbo": True}),
                       r"got unknown \['turbo'\], missing \[\]"),
    "layer-out-of-range": (_meta("layers", lambda ids: ids + [9]),
                           r"metadata 'layers' \[9\] outside the model's layers"),
    "unreadable-json": (lambda t, m: m.update(settings="{oops"), r"unreadable metadata"),
    "missing-codebook": (_drop("layers.1.v_codebook"), r"missing tensors \['layers.1.v_codebook'\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_file_raises_naming_the_problem(good_file, tmp_path, case):
    edit, match = BAD[case]
    tensors, metadata = _contents(good_file)
    edit(tensors, metadata)
    path = tmp_path / f"{case}.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ValueError, match=match):
        load_calibration(path)


@pytest.mark.parametrize("case", ["random-bytes", "truncated", "empty", "plain-safetensors"])
def test_not_a_calibration_file_raises(good_file, tmp_path, case):
    path = tmp_path / f"{case}.safetensors"
    if case == "random-bytes":
        path.write_bytes(os.urandom(4096))
    elif case == "truncated":
        path.write_bytes(good_file.read_bytes()[:-100])
    elif case == "empty":
        path.write_bytes(b"")
    else:
        save_file({"x": torch.zeros(2)}, str(path))
    match = "lacks metadata" if case == "plain-safetensors" else "corrupt or truncated"
    with pytest.raises(ValueError, match=match):
        load_calibration(path)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_another_models_file_raises_at_load(good_file, family):
    other = make_model(family)
    with pytest.raises(ValueError, match=r"was made for another model \(file, model\): .*model_type"):
        load_calibration(good_file, model=other.config)
    assert load_calibration(good_file, model=make_model("llama").config).model["model_type"] == "llama"


def test_missing_path_names_what_is_allowed(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist; allowed: a .safetensors file, a folder"):
        load_calibration(tmp_path / "nope.safetensors")
