"""The preset table (qcache/presets.py): complete frozen rows, `recipe()` as a lookup plus `replace`, nothing derived;
invalid combinations refused in the part they belong to, naming every conflicting option; old files' options read."""

import dataclasses

import pytest

from conftest import make_model
from qcache import QuantCache, QuantCacheConfig
from qcache.presets import DEFAULT_PRESET, PRESETS, recipe
from qcache.calibfile import legacy_recipe
from test_cache import generate, prompt

# what distinguishes each row (every other field is the dataclass default); a change here is a change of defaults
ROWS = {
    "k8v8": dict(k_bits=8, v_bits=8, window_bits=16),
    "k4v4": dict(),
    "k4v3": dict(v_bits=3),
    "k3v3": dict(k_bits=3, v_bits=3),
    "k3v2": dict(k_bits=3, v_bits=2, recent_tokens=256),
    "k2v2": dict(k_bits=2, v_bits=2, levels="lloyd-max", codebooks=False),
}
BASE = dict(k_bits=4, v_bits=4, k_group_size=128, v_group_size=None, sink_tokens=4, recent_tokens=128, rope="pre",
            sliding_layers="native", scale_dtype="float16", clip_search=False, codebooks=True, static_keys=False,
            kernel="auto", outliers=0, rotation="hadamard", rotation_seed=0, levels="uniform", rotate="auto",
            v_scale="norm", window_bits=8, window_keys="rotated", layer_bits=None, sliding_bits=None,
            sliding_v_bits=None)


def test_the_table_is_these_rows():
    assert sorted(PRESETS) == sorted(ROWS)
    assert QuantCacheConfig().to_dict() == BASE and PRESETS[DEFAULT_PRESET] == QuantCacheConfig()
    for name, row in PRESETS.items():
        assert row.to_dict() == {**BASE, **ROWS[name]}, name
        assert QuantCacheConfig.from_dict(row.to_dict()) == row  # a complete recipe round-trips
        with pytest.raises(dataclasses.FrozenInstanceError):
            row.recent_tokens = 0


def test_a_recipe_written_before_window_keys_means_minmax_window_keys():
    """Calibration files (format 3) and saved caches written before `window_keys` existed held their 8-bit window's
    keys unrotated: reading their recipe keeps that."""
    old = QuantCacheConfig().to_dict()
    del old["window_keys"]
    assert QuantCacheConfig.from_dict(old) == dataclasses.replace(QuantCacheConfig(), window_keys="minmax")
    with pytest.raises(ValueError, match=r"missing \['window_bits'\]"):
        QuantCacheConfig.from_dict({k: v for k, v in QuantCacheConfig().to_dict().items() if k != "window_bits"})


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bits_n_is_a_lookup_of_the_knvn_row(bits):
    assert recipe(bits=bits) is PRESETS[f"k{bits}v{bits}"]
    assert QuantCache(bits=bits).options == PRESETS[f"k{bits}v{bits}"]


def test_widths_pick_their_row_and_options_replace_fields():
    assert recipe(k_bits=3, v_bits=2) == PRESETS["k3v2"]
    assert recipe(k_bits=4, v_bits=2) == dataclasses.replace(QuantCacheConfig(), v_bits=2)  # no row: the default's
    assert recipe(layer_bits="k4v4+k8v2") == dataclasses.replace(QuantCacheConfig(), layer_bits=((4, 4), (8, 2)))
    assert recipe(preset="k3v3", recent_tokens=64) == dataclasses.replace(PRESETS["k3v3"], recent_tokens=64)
    assert recipe(preset="k3v2", k_bits=4).to_dict() == {**PRESETS["k3v2"].to_dict(), "k_bits": 4}
    assert recipe() == QuantCacheConfig() and recipe(bits=None, window_bits=None) == QuantCacheConfig()
    opts = QuantCache(preset="k3v2", k_bits=4, v_bits=4).options
    assert (opts.k_bits, opts.v_bits, opts.recent_tokens) == (4, 4, 256)


@pytest.mark.parametrize("call,match", [
    (lambda: recipe(bits=5), r"bits=5 is not supported; allowed values: \[2, 3, 4, 8\]"),
    (lambda: recipe(preset="k5"), r"preset='k5' is not a preset; allowed values: \['k8v8', 'k4v4'"),
    (lambda: recipe(preset="k3v3", bits=4), r"preset='k3v3' and bits=4 both choose a row"),
    (lambda: recipe(bits=4, k_bits=2), r"bits=4 and \['k_bits'\] both set widths"),
    (lambda: recipe(bits=4, windw_bits=16), r"unknown QuantCache options \['windw_bits'\]"),
    (lambda: QuantCache(preset="k3v3", calibration="x.safetensors"), r"preset='k3v3' chooses a recipe"),
    (lambda: QuantCache(options=QuantCacheConfig(), bits=4), r"pass either options= or keyword options"),
])
def test_bad_lookups_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("given,match", [
    # one error names every option that conflicts, and what is allowed with the one given
    ({"rotation": "none"}, r"rotation='none' rotates nothing: rotate='auto' needs a rotation; v_scale='norm' needs "
                           r"rotated values .*allowed with it: rotate='kv', v_scale='minmax'"),
    ({"static_keys": True}, r"rotation='hadamard' is not supported with static_keys=True .*allowed with it: "
                            r"rotation='none', rotate='kv', v_scale='minmax'"),
    ({"v_group_size": 32}, r"v_scale='norm' scales whole heads .*got v_group_size=32; allowed with it: "
                           r"v_group_size=None, or v_scale='minmax'"),
    ({"outliers": 1, "clip_search": True}, r"got outliers=1; got clip_search=True; allowed with it: outliers=0, "
                                           r"clip_search=False, or v_scale='minmax'"),
    ({"sliding_bits": 8}, r"sliding_bits=8 sets the width of quantized sliding-window layers"),
    ({"window_bits": 4}, r"window_bits=4 is not supported; allowed values: \[16, 8\]"),
])
def test_invalid_combinations_fail_in_their_part(given, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(QuantCacheConfig(), **given)


def test_a_calibration_file_stores_its_recipe_and_old_files_read_through_one_reader():
    row = recipe(bits=3, recent_tokens=64)
    assert QuantCacheConfig.from_dict(row.to_dict()) == row
    with pytest.raises(ValueError, match=r"missing \['window_bits'\]"):
        QuantCacheConfig.from_dict({k: v for k, v in row.to_dict().items() if k != "window_bits"})
    # a file written before rotation, Lloyd-Max levels, norm values and the 8-bit window existed: what it meant
    old = {"k_bits": 4, "v_bits": 2, "k_group_size": 64, "sink_tokens": 4, "recent_tokens": 128,
           "static_keys": True, "codebooks": None}
    read = legacy_recipe(old)
    assert (read.rotation, read.rotate, read.v_scale, read.levels, read.window_bits, read.codebooks) == (
        "none", "kv", "minmax", "uniform", 16, True)
    assert legacy_recipe({**PRESETS["k4v4"].to_dict(), "bits": 3}).v_bits == 3
    with pytest.raises(ValueError, match=r"unknown QuantCacheConfig options \['bogus'\]"):
        legacy_recipe({"bogus": 1})


@pytest.mark.parametrize("given,streams", [
    ({}, "k"), ({"rotation": "none", "rotate": "kv", "v_scale": "minmax"}, "kv"), ({"rotate": "k", "v_scale": "minmax"},
                                                                                 "v"),
    ({"rotate": "kv"}, ""), ({"rotate": "v", "v_scale": "minmax"}, "k"),
])
def test_codebook_streams(given, streams):
    assert dataclasses.replace(QuantCacheConfig(), **given).codebook_streams() == streams


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_generates(name):
    model = make_model("llama")
    cache = QuantCache(preset=name, recent_tokens=4, k_group_size=16)
    generate(model, prompt(60), cache, max_new_tokens=3)
    layer, row = cache.layers[0], PRESETS[name]
    assert (layer.k_codec.bits, layer.v_codec.bits) == (row.k_bits, row.v_bits)
    assert layer.v_codec.norm and layer.v_codec.rotation and not layer.k_codec.rotation
    assert (layer.window_codecs is not None) == (row.window_bits == 8) and layer.quantized_length > 0


def test_eval_spec_label():
    from eval.compare import CacheSpec
    from eval.options import parse_cache_options

    spec = CacheSpec.parse("quant::preset=k3v2,recent_tokens=128")
    assert spec.label == "quant-k3v2(recent_tokens=128)"
    assert parse_cache_options(spec.options) == (None, {"preset": "k3v2", "recent_tokens": 128})


def test_the_documented_table_is_the_table():
    """docs/options.md's preset table shows, per row, the fields where rows differ: read back, each cell is the row's."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text()
    lines = [line for line in text.splitlines() if line.startswith("| `k")]
    header = next(line for line in text.splitlines() if line.startswith("| preset |"))
    columns = [c.strip() for c in header.strip("|").split("|")][2:]
    varying = {name for row in ROWS.values() for name in row}
    assert set(columns) == varying  # every field some row changes has a column, and no other
    seen = set()
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].strip("`")
        if name not in PRESETS:
            continue
        seen.add(name)
        row = PRESETS[name].to_dict()
        assert cells[2:] == [str(row[c]) for c in columns], name
    assert seen == set(PRESETS)
