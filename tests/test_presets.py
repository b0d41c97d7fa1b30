"""qcache/presets.py: named settings, overridable, refused with options=/calibration=, usable from eval specs."""

import pytest

from conftest import make_model
from qcache import QuantCache
from qcache.presets import PRESETS, preset_options
from test_cache import generate, prompt


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_generates(name):
    model = make_model("llama")
    cache = QuantCache(preset=name, recent_tokens=4, k_group_size=16)
    generate(model, prompt(60), cache, max_new_tokens=3)
    layer = cache.layers[0]
    assert (layer.k_codec.bits, layer.v_codec.bits) == (PRESETS[name]["k_bits"], PRESETS[name]["v_bits"])
    assert layer.v_codec.norm and layer.v_codec.rotation and not layer.k_codec.rotation
    assert layer.window_codecs is not None and layer.quantized_length > 0


def test_overrides_and_refusals():
    assert preset_options("k3v2", bits=4) == {**{k: v for k, v in PRESETS["k3v2"].items() if k not in ("k_bits",
                                                                                                       "v_bits")},
                                              "bits": 4}
    opts = QuantCache(preset="k3v2", bits=4).options
    assert (opts.k_bits, opts.v_bits, opts.recent_tokens) == (4, 4, 256)
    assert QuantCache(preset="k4v4", window_bits=16).options.window_bits == 16
    with pytest.raises(ValueError, match=r"preset='k5' is not a preset; allowed values: \['k4v4', 'k4v3'"):
        QuantCache(preset="k5")
    with pytest.raises(ValueError, match=r"preset='k3v3' sets the options itself"):
        QuantCache(preset="k3v3", calibration="x.safetensors")


def test_eval_spec_label():
    from eval.compare import CacheSpec
    from eval.options import parse_cache_options

    spec = CacheSpec.parse("quant::preset=k3v2,recent_tokens=128")
    assert spec.label == "quant-k3v2(recent_tokens=128)"
    assert parse_cache_options(spec.options) == (None, {"preset": "k3v2", "recent_tokens": 128})
