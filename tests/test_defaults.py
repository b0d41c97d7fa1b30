"""The defaults of QuantCacheConfig: bits=2/3/4 are the measured presets, and the options left at None follow from
the others (also when a calibration file's options are overridden)."""

import pytest

from qcache import QuantCacheConfig
from qcache.config import AUTO_OPTIONS
from qcache.presets import preset_options


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bits_n_is_the_knvn_preset(bits):
    preset = QuantCacheConfig(**preset_options(f"k{bits}v{bits}"))
    assert QuantCacheConfig(bits=bits).to_dict() == preset.to_dict()
    d = QuantCacheConfig(bits=bits).to_dict()
    assert (d["rotation"], d["rotate"], d["v_scale"], d["k_group_size"], d["window_bits"], d["levels"]) == (
        "hadamard", "auto", "norm", 128, 8, "lloyd-max" if bits == 2 else "uniform")


@pytest.mark.parametrize("given,resolved", [
    # the defaults: keys rotated per layer ("auto"); the layers that keep them unrotated take a calibration file's
    # codebooks, rotated "norm" values their Gaussian levels
    ({}, dict(rotation="hadamard", rotate="auto", v_scale="norm", codebooks=True, window_bits=8)),
    ({"bits": 8}, dict(rotation="hadamard", rotate="auto", v_scale="norm", codebooks=True, window_bits=16)),
    ({"layer_bits": [(4, 4), (8, 2)]}, dict(window_bits=16)),
    ({"static_keys": True}, dict(rotation="none", rotate="kv", v_scale="minmax", codebooks=True)),
    ({"rotation": "none"}, dict(rotate="kv", v_scale="minmax", codebooks=True, window_bits=8)),
    ({"rotation": "hadamard"}, dict(rotate="auto", v_scale="norm", codebooks=True)),
    ({"rotate": "v"}, dict(v_scale="norm", codebooks=True)),
    ({"rotate": "kv"}, dict(v_scale="norm", codebooks=False)),  # no stream left unrotated
    ({"rotate": "k"}, dict(v_scale="minmax", codebooks=True)),  # unrotated min-max values
    ({"rotate": "k"}, dict(rotation="hadamard", v_scale="minmax")),
    ({"v_group_size": 32}, dict(v_scale="minmax")),
    ({"outliers": 1}, dict(v_scale="minmax")),
    ({"clip_search": True}, dict(v_scale="minmax")),
    ({"rotation": "none", "levels": "lloyd-max"}, dict(codebooks=False)),
    ({"window_bits": 16}, dict(window_bits=16)),
    # 2-bit keys on Lloyd-Max levels (and no codebooks), unless something asks for uniform ones
    ({"bits": 2}, dict(levels="lloyd-max", codebooks=False)),
    ({"k_bits": 2, "v_bits": 4}, dict(levels="lloyd-max")),  # "norm" values keep their own levels
    ({"k_bits": 2, "v_bits": 4, "rotation": "none"}, dict(levels="uniform")),  # min-max 4-bit values: not measured
    ({"k_bits": 4, "v_bits": 2}, dict(levels="uniform", codebooks=True)),
    ({"bits": 2, "codebooks": True}, dict(levels="uniform")),
    ({"bits": 2, "static_keys": True}, dict(levels="uniform", rotation="none")),
    ({"layer_bits": [(2, 2), (2, 3)]}, dict(levels="lloyd-max")),
    ({"layer_bits": [(2, 2), (3, 2)]}, dict(levels="uniform")),
])
def test_options_left_unset_follow_from_the_others(given, resolved):
    d = QuantCacheConfig(**given).to_dict()
    assert {k: d[k] for k in resolved} == resolved
    assert all(d[name] is not None for name in AUTO_OPTIONS)
    assert QuantCacheConfig.from_dict(d).to_dict() == d  # round trip


def test_overriding_stored_options_resolves_the_defaults_again():
    made_with_defaults = QuantCacheConfig(bits=3).to_dict()
    static = QuantCacheConfig.overridden(made_with_defaults, {"static_keys": True})
    assert (static.rotation, static.rotate, static.v_scale, static.codebooks, static.k_bits) == (
        "none", "kv", "minmax", True, 3)
    assert QuantCacheConfig.overridden(made_with_defaults, {"bits": 8}).window_bits == 16
    # values that are not what the defaults would give stay, and a conflict with them raises
    old_file = QuantCacheConfig(bits=2, static_keys=True, window_bits=16).to_dict()
    kept = QuantCacheConfig.overridden(old_file, {"recent_tokens": 64})
    assert (kept.static_keys, kept.rotation, kept.window_bits, kept.recent_tokens) == (True, "none", 16, 64)
    with pytest.raises(ValueError, match="rotation='hadamard' is not supported with static_keys=True"):
        QuantCacheConfig.overridden(old_file, {"rotation": "hadamard"})
    # a 2-bit file on uniform levels with its codebooks (made before 2-bit keys took Lloyd-Max levels) keeps both:
    # each looks like a default given the other, but released together they would resolve to Lloyd-Max, no codebooks
    uniform_file = QuantCacheConfig(bits=2, levels="uniform").to_dict()
    kept = QuantCacheConfig.overridden(uniform_file, {"recent_tokens": 64})
    assert (kept.levels, kept.codebooks) == ("uniform", True)
    assert QuantCacheConfig.overridden(QuantCacheConfig(bits=2).to_dict(), {"bits": 3}).levels == "uniform"
    assert QuantCacheConfig.overridden(made_with_defaults, {"bits": 2}).levels == "lloyd-max"


@pytest.mark.parametrize("given,streams", [
    ({}, "k"), ({"rotation": "none"}, "kv"), ({"rotate": "k"}, "v"), ({"rotate": "kv"}, ""),
    ({"rotate": "v", "v_scale": "minmax"}, "k"), ({"static_keys": True}, "kv"),
])
def test_codebook_streams(given, streams):
    assert QuantCacheConfig(**given).codebook_streams() == streams
