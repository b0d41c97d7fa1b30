"""Tests for qcache.tools.size: published KV-cache figures from geometry alone, format ratios, sliding layers, the CLI."""

from __future__ import annotations

import json
import sys
import types

import pytest

from qcache import layout
from qcache.presets import recipe
from qcache.tools.size import (
    FORMATS,
    GIB,
    KIB,
    PLAIN_FORMATS,
    QCACHE_FORMATS,
    Geometry,
    cache_bytes,
    crossover_tokens,
    first_context_above,
    kv_bytes_per_token,
    load_config,
    main,
    requests_that_fit,
    resolve_config_source,
    safetensors_param_count,
    size_table,
)

# (name, layers, kv_heads, head_dim, KiB/token at 16 bits): published figures
PUBLISHED = [
    ("llama-3.1-8b", 32, 8, 128, 128),
    ("qwen3-8b", 36, 8, 128, 144),
    ("llama-2-7b", 32, 32, 128, 512),
    ("gpt-oss-20b", 24, 8, 64, 48),
]
LLAMA31_8B = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128"]


def _row(rows: list[dict], fmt: str) -> dict:
    return next(r for r in rows if r["format"] == fmt)


def _cells(table: str, fmt: str) -> list[str]:
    """The stripped cells of the markdown row for `fmt`."""
    line = next(line for line in table.splitlines() if line.startswith(f"| {fmt} "))
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tiny_gemma3(sliding_window: int = 512):
    from transformers import Gemma3TextConfig

    # 6 layers: 5 sliding + 1 full (Gemma 3's default 5:1 pattern)
    return Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            hidden_size=128, intermediate_size=256, vocab_size=256, sliding_window=sliding_window,
                            max_position_embeddings=32768)


# --- published figures ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,layers,kv_heads,head_dim,kib", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_published_kib_per_token(name, layers, kv_heads, head_dim, kib):
    assert kv_bytes_per_token(layers, kv_heads, head_dim, 2) == kib * KIB
    row = _row(size_table(Geometry(layers, kv_heads, head_dim), 131072), "16-bit")
    assert row["kib_per_token"] == kib


@pytest.mark.parametrize("layers,kv_heads,head_dim,context,gib", [
    (32, 8, 128, 131072, 16.0),  # Llama-3.1-8B at its full 128k context
    (36, 8, 128, 32768, 4.5),  # Qwen3-8B at its native 32k
])
def test_published_gib_at_context(layers, kv_heads, head_dim, context, gib):
    row = _row(size_table(Geometry(layers, kv_heads, head_dim), context), "16-bit")
    assert row["gib_at_context"] == gib
    assert row["full_gib"] == gib and row["sliding_gib"] == 0


def test_llama31_8b_24_requests_of_8k_fit_24_gib():
    per_request = kv_bytes_per_token(32, 8, 128, 2) * 8192
    assert per_request == 1 * GIB
    assert requests_that_fit(24 * GIB, per_request) == 24
    row = _row(size_table(Geometry(32, 8, 128), 131072, budget_bytes=24 * GIB, request_tokens=8192), "16-bit")
    assert row["requests_that_fit"] == 24


# --- pure functions -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget,per_request,expected", [(24, 1, 24), (24, 5, 4), (0, 3, 0), (2.5, 1, 2)])
def test_requests_that_fit_floors(budget, per_request, expected):
    assert requests_that_fit(budget * GIB, per_request * GIB) == expected


@pytest.mark.parametrize("weights,bpt,expected", [(100, 10, 11), (105, 10, 11), (0, 10, 1), (16 * GIB, 128 * KIB, 131073)])
def test_crossover_tokens_is_first_context_strictly_above(weights, bpt, expected):
    n = crossover_tokens(weights, bpt)
    assert n == expected
    assert n * bpt > weights >= (n - 1) * bpt


@pytest.mark.parametrize("weights_gib", [0.25, 14.96, 40.0])
def test_first_context_above_matches_crossover_for_a_constant_rate(weights_gib):
    bpt = kv_bytes_per_token(32, 8, 128, 2)
    assert first_context_above(weights_gib * GIB, lambda n: n * bpt) == crossover_tokens(weights_gib * GIB, bpt)


def test_first_context_above_none_when_the_cache_is_bounded():
    assert first_context_above(10.0, lambda n: min(n, 5)) is None


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "fp8", "16-bit"])
@pytest.mark.parametrize("layers,kv_heads,head_dim", [p[1:4] for p in PUBLISHED], ids=[p[0] for p in PUBLISHED])
def test_plain_rows_follow_the_formula(fmt, layers, kv_heads, head_dim):
    expected_bpv = {"q8_0": 1.0625, "q4_0": 0.5625, "fp8": 1.0, "16-bit": 2.0}[fmt]
    assert PLAIN_FORMATS[fmt] == expected_bpv
    row = _row(size_table(Geometry(layers, kv_heads, head_dim), 131072), fmt)
    assert row["bytes_per_token"] == 2 * layers * kv_heads * head_dim * expected_bpv


@pytest.mark.parametrize("context", [8192, 32768, 131072])
@pytest.mark.parametrize("layers,kv_heads,head_dim", [p[1:4] for p in PUBLISHED], ids=[p[0] for p in PUBLISHED])
def test_qcache_rows_smaller_than_16bit_and_ordered_by_bits(layers, kv_heads, head_dim, context):
    rows = size_table(Geometry(layers, kv_heads, head_dim), context)
    sixteen = _row(rows, "16-bit")["bytes_per_token"]
    qcache = [_row(rows, f"qcache-{b}bit")["bytes_per_token"] for b in (8, 4, 3, 2)]
    assert all(q < sixteen for q in qcache)
    assert qcache == sorted(qcache, reverse=True) and len(set(qcache)) == 4  # 8 > 4 > 3 > 2 bits


@pytest.mark.parametrize("bits", sorted(QCACHE_FORMATS.values()))
def test_qcache_rows_match_quant_cache_config(bits):
    g, context = Geometry(32, 8, 128), 131072
    row = _row(size_table(g, context), f"qcache-{bits}bit")
    assert row["bytes_per_token"] == layout.bytes_per_token(recipe(bits=bits), 32, 8, 128, context, fp_bytes=2)


def test_size_table_rows_in_format_order():
    assert [r["format"] for r in size_table(Geometry(32, 8, 128), 4096)] == list(FORMATS)


# --- sliding layers -------------------------------------------------------------------------------------------------


def test_geometry_from_gemma3_text_config_splits_full_and_sliding():
    g = Geometry.from_config(_tiny_gemma3())
    assert g == Geometry(layers=6, kv_heads=2, head_dim=64, sliding_layers=5, sliding_window=512)
    assert g.full_layers == 1


def test_geometry_from_multimodal_config_reads_the_text_config():
    from transformers import Gemma3Config

    g = Geometry.from_config(Gemma3Config(text_config=_tiny_gemma3().to_dict()))
    assert (g.layers, g.sliding_layers, g.sliding_window) == (6, 5, 512)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sliding_layers_hold_fewer_bytes_at_long_context(fmt):
    sliding = Geometry.from_config(_tiny_gemma3())
    dense = Geometry(sliding.layers, sliding.kv_heads, sliding.head_dim)
    context = 32768
    assert sum(cache_bytes(sliding, fmt, context)) < sum(cache_bytes(dense, fmt, context))
    # sliding layers stop growing at the window
    assert cache_bytes(sliding, fmt, 4096)[1] == cache_bytes(sliding, fmt, context)[1]


def test_sliding_layers_cost_nothing_extra_within_the_window():
    sliding = Geometry(6, 2, 64, sliding_layers=5, sliding_window=512)
    dense = Geometry(6, 2, 64)
    assert sum(cache_bytes(sliding, "16-bit", 512)) == sum(cache_bytes(dense, "16-bit", 512))


@pytest.mark.parametrize("mode", ["native", "quantized"])
def test_qcache_sliding_mode(mode):
    g = Geometry(6, 2, 64, sliding_layers=5, sliding_window=512)
    _, sliding = cache_bytes(g, "qcache-4bit", 32768, {"sliding_layers": mode})
    sixteen = cache_bytes(g, "16-bit", 32768)[1]
    assert sliding == sixteen if mode == "native" else sliding < sixteen


@pytest.mark.parametrize("kwargs,expected", [
    ({"sliding_window": None}, (6, 0, None)),  # no window: every layer keeps every token
    ({"layer_types": ["sliding_attention", "full_attention"] * 3}, (6, 3, 512)),
])
def test_geometry_from_config_layer_types(kwargs, expected):
    from transformers import PretrainedConfig

    fields = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256,
              "sliding_window": 512}
    config = PretrainedConfig(**{**fields, **kwargs})
    g = Geometry.from_config(config)
    assert (g.layers, g.sliding_layers, g.sliding_window) == expected
    assert g.head_dim == 64  # hidden_size // num_attention_heads


def test_layer_types_quantcache_refuses_are_refused_here_too():
    from transformers import PretrainedConfig

    config = PretrainedConfig(num_hidden_layers=4, num_attention_heads=4, hidden_size=256,
                              layer_types=["full_attention", "linear_attention"] * 2)
    with pytest.raises(ValueError, match=r"\['linear_attention'\].*supported: \['full_attention', 'sliding_attention'\]"):
        Geometry.from_config(config)


def test_model_option_is_the_positional_model(capsys):
    from qcache.tools.size import main

    assert main(["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--context", "1024"]) == 0
    with pytest.raises(SystemExit):
        main(["a-model", "--model", "another-model"])
    assert "two models given" in capsys.readouterr().err


def test_geometry_from_config_kv_heads_falls_back_to_attention_heads():
    from transformers import PretrainedConfig

    g = Geometry.from_config(PretrainedConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=256))
    assert (g.kv_heads, g.head_dim) == (4, 64)


# --- bad input ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,match", [
    ({"layers": 0, "kv_heads": 8, "head_dim": 128}, "layers=0"),
    ({"layers": 32, "kv_heads": -1, "head_dim": 128}, "kv_heads=-1"),
    ({"layers": 32, "kv_heads": 8, "head_dim": 0}, "head_dim=0"),
    ({"layers": 32, "kv_heads": 8, "head_dim": 128, "sliding_layers": 40, "sliding_window": 512}, "sliding_layers=40"),
    ({"layers": 32, "kv_heads": 8, "head_dim": 128, "sliding_layers": 4}, "sliding_window"),
    ({"layers": 32, "kv_heads": 8, "head_dim": 128, "sliding_layers": 4, "sliding_window": 0}, "sliding_window=0"),
])
def test_bad_geometry_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Geometry(**kwargs)


@pytest.mark.parametrize("call,match", [
    (lambda: cache_bytes(Geometry(32, 8, 128), "q5_k", 10), "q5_k"),
    (lambda: size_table(Geometry(32, 8, 128), 0), "context=0"),
    (lambda: size_table(Geometry(32, 8, 128), 10, request_tokens=-5), "request_tokens=-5"),
    (lambda: requests_that_fit(24 * GIB, 0), "bytes_per_request=0"),
    (lambda: crossover_tokens(GIB, 0), "bytes_per_token=0"),
    (lambda: size_table(Geometry(32, 8, 84), 4096), "head_dim=84"),  # not a multiple of 8: codes cannot be packed
    (lambda: load_config("/nonexistent/model"), "/nonexistent/model"),
    (lambda: resolve_config_source("/nonexistent/config.json"), "/nonexistent/config.json"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.fixture
def fake_models(monkeypatch, tmp_path):
    """A stand-in `qcache.tools.models` whose only known short name is 'tiny-gemma3' (no downloads)."""
    model_dir = tmp_path / "tiny-gemma3"
    _tiny_gemma3().save_pretrained(model_dir)

    def resolve_model(name: str):
        if name != "tiny-gemma3":
            raise ValueError(f"unknown model {name!r}; allowed: ['tiny-gemma3']")
        return model_dir

    module = types.ModuleType("qcache.tools.models")
    module.resolve_model = resolve_model
    monkeypatch.setitem(sys.modules, "qcache.tools.models", module)
    return model_dir


def test_short_name_goes_through_resolve_model(fake_models):
    assert resolve_config_source("tiny-gemma3") == fake_models


def test_unknown_short_name_raises(fake_models):
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_config_source("no-such-model")


# --- CLI ------------------------------------------------------------------------------------------------------------


def test_cli_explicit_geometry_prints_published_numbers(capsys):
    assert main([*LLAMA31_8B, "--context", "131072"]) == 0
    out = capsys.readouterr().out
    assert _cells(out, "16-bit") == ["16-bit", "131072", "128.00", "16.00", "24"]
    assert "| GiB @ 131072 |" in out and "requests of 8192 in 24 GiB" in out
    for fmt in FORMATS:
        assert f"| {fmt} " in out


def test_cli_default_context_with_explicit_geometry_is_128k(capsys):
    main(["--layers", "36", "--kv-heads", "8", "--head-dim", "128", "--formats", "16-bit"])
    out = capsys.readouterr().out
    assert "GiB @ 131072" in out
    assert _cells(out, "16-bit") == ["16-bit", "147456", "144.00", "18.00", "21"]


def test_cli_json(capsys):
    assert main([*LLAMA31_8B, "--context", "131072", "--json", "--weights-gib", "16"]) == 0
    result = json.loads(capsys.readouterr().out)
    row = _row(result["rows"], "16-bit")
    assert row["kib_per_token"] == 128 and row["gib_at_context"] == 16.0 and row["requests_that_fit"] == 24
    assert row["crossover_tokens"] == 131073  # 16 GiB of weights = 16-bit cache at 128k: passed one token later
    assert result["geometry"] == {"layers": 32, "kv_heads": 8, "head_dim": 128, "sliding_layers": 0,
                                  "sliding_window": None}


def test_cli_model_dir_counts_weights_and_lists_sliding_layers(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    _tiny_gemma3().save_pretrained(tmp_path)
    save_file({"a": torch.zeros(1000, 64, dtype=torch.bfloat16), "b": torch.zeros(24, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    assert safetensors_param_count(tmp_path) == 64024
    for source in (str(tmp_path), str(tmp_path / "config.json")):
        assert main([source, "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["weights_bytes"] == 64024 * 2
        assert result["context"] == 32768  # the config's max_position_embeddings
        assert result["geometry"]["sliding_layers"] == 5
        assert all(r["crossover_tokens"] is not None for r in result["rows"])
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 full, 5 sliding with window 512" in out
    assert "full layers GiB @ 32768" in out and "sliding layers GiB @ 32768" in out
    assert "passes weights at (tokens)" in out


def test_cli_short_name(fake_models, capsys):
    assert main(["tiny-gemma3", "--formats", "16-bit", "q4_0"]) == 0
    out = capsys.readouterr().out
    assert "tiny-gemma3: 6 layers" in out and "| q4_0 " in out and "qcache" not in out


@pytest.mark.parametrize("argv,match", [
    (["--layers", "0", "--kv-heads", "8", "--head-dim", "128"], "layers=0"),
    (["--layers", "32", "--kv-heads", "8"], "--head-dim"),
    (["/does/not/exist"], "/does/not/exist"),
    (["no-such-model"], "no-such-model"),
    ([*LLAMA31_8B, "--budget-gib", "-1"], "--budget-gib=-1"),
    ([*LLAMA31_8B, "--context", "0"], "context=0"),
    ([*LLAMA31_8B, "--formats", "q5_k"], "q5_k"),
])
def test_cli_bad_input_exits_with_the_value_named(argv, match, capsys, fake_models):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_8bit_sliding_layers_are_estimated_as_their_window_in_8bit_tokens():
    g = Geometry(6, 2, 64, sliding_layers=5, sliding_window=512)
    cfg = {"sliding_layers": "quantized", "sliding_bits": 8}
    _, sliding = cache_bytes(g, "qcache-4bit", 32768, cfg)
    # per sliding layer: 512 tokens x 2 heads x K and V x (64 one-byte codes + a float16 scale and zero), + the
    # int64 first position
    assert sliding == pytest.approx(5 * (512 * 2 * 2 * (64 + 4) + 8))
    assert sliding < 0.55 * cache_bytes(g, "16-bit", 32768)[1]


@pytest.mark.parametrize("rotation,per_token", [("hadamard", 64 // 2 + 2), ("none", 64 // 2 + 64 // 16 * 4)])
def test_token_sliding_layers_are_estimated_as_their_window_of_4bit_tokens(rotation, per_token):
    g = Geometry(6, 2, 64, sliding_layers=5, sliding_window=512)
    cfg = {"sliding_layers": "tokens", "sliding_bits": 4, "rotation": rotation}
    if rotation == "none":
        cfg.update(v_group_size=16, rotate="kv", v_scale="minmax")
    _, sliding = cache_bytes(g, "qcache-2bit", 32768, cfg)
    # per sliding layer: 512 tokens x 2 heads x K and V x (32 bytes of 4-bit codes + one float16 scale, or a scale
    # and a zero per 16 channels unrotated), + the int64 first position
    assert sliding == pytest.approx(5 * (512 * 2 * 2 * per_token + 8))


def test_split_token_sliding_layers_are_estimated_per_stream():
    g = Geometry(6, 2, 64, sliding_layers=5, sliding_window=512)
    cfg = {"sliding_layers": "tokens", "sliding_bits": 8, "sliding_v_bits": 4}
    _, sliding = cache_bytes(g, "qcache-2bit", 32768, cfg)
    # keys: 64 one-byte codes + a float16 scale and zero; values: 32 bytes of 4-bit codes + one float16 scale
    assert sliding == pytest.approx(5 * (512 * 2 * ((64 + 4) + (32 + 2)) + 8))


def test_values_of_another_width_than_keys_are_refused_by_name():
    """MiMo-V2-Flash's values (v_head_dim) are wider than its keys: the table, which sizes one width, says so."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("mimo_v2_flash", head_dim=32, v_head_dim=64)
    with pytest.raises(ValueError, match=r"head_dim 32 and values of v_head_dim 64"):
        Geometry.from_config(config)
