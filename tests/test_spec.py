"""One spec syntax (`qcache.tools.spec`): eval's cache specs, bench's rows and the calibrate CLI's --cache read the same
grammar and type values the same way."""

import sys
from pathlib import Path

import pytest

from calibration.cli import cache_options, parse_option
from eval.compare import CacheSpec
from eval.options import parse_cache_options
from qcache.presets import recipe
from qcache.tools.spec import parse_spec, typed_option

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_speed import Row  # noqa: E402

SPECS = ["quant:4", "quant:3:recent_tokens=64,kernel=eager", "quant::preset=k3v2", "quant::k_bits=4,v_bits=2",
         "quant:2:rotation=none,rotate=kv,v_scale=minmax,v_group_size=16"]


@pytest.mark.parametrize("text", SPECS)
def test_every_reader_builds_the_same_recipe(text):
    kind, bits, raw = parse_spec(text)
    assert kind == "quant"
    # eval: CacheSpec + lm-eval's option typing
    spec = CacheSpec.parse(text)
    ebits, eopts = parse_cache_options({**spec.options, **({"bits": spec.bits} if spec.bits else {})})
    from_eval = recipe(ebits, **eopts)
    # bench: a row is the same spec (plus @attention)
    row = Row.parse(text + "@fp32")
    assert row.attn == "fp32" and row.bits == bits
    from_bench = recipe(row.bits, **dict(row.options))
    # calibrate: --cache
    given = cache_options(text)
    from_cli = recipe(preset=given.pop("preset", None), **given)
    assert from_eval == from_bench == from_cli
    assert Row.parse(row.spec) == row  # the spec a row writes reads back as that row


def test_values_are_typed_by_the_field_they_name():
    assert typed_option("recent_tokens", "64") == 64 and typed_option("clip_search", "yes") is True
    assert typed_option("rotation", "none") == "none"  # a value of rotation, not None
    assert typed_option("v_group_size", "none") is None and typed_option("sliding_bits", "8") == 8
    assert typed_option("layer_bits", "k3v3x2") == ((3, 3), (3, 3))
    assert parse_option("codebooks=false") == ("codebooks", False)
    with pytest.raises(ValueError, match=r"recent_tokens='many' must be an integer"):
        typed_option("recent_tokens", "many")
    with pytest.raises(ValueError, match=r"unknown cache option 'colour'; allowed: \[.*'bits'"):
        typed_option("colour", "blue")


@pytest.mark.parametrize("text,match", [
    ("quant:four", r"bits 'four' must be an integer"),
    ("quant:4:recent_tokens", r"option 'recent_tokens' must be NAME=VALUE"),
    ("quant:4:kernel=eager,kernel=compiled", r"option 'kernel' given twice"),
    ("bogus:4", r"kind 'bogus' is not supported; allowed: \['quant'\]"),
])
def test_bad_specs_name_the_bad_part(text, match):
    with pytest.raises(ValueError, match=match):
        cache_options(text)


def test_calibrate_cache_refuses_a_second_way_to_say_it(tmp_path, capsys):
    from calibration import cli

    with pytest.raises(SystemExit):
        cli.main(["--out", str(tmp_path / "x.safetensors"), "--cache", "quant:3", "--bits", "2"])
    assert "allowed without it: --bits" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"bits=3 and \['k_bits'\] both choose the widths"):
        cache_options("quant:3:k_bits=2")
