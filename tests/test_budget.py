"""Per-layer widths: `layer_bits` in the options and the cache, and `calibration.budget` (sensitivities measured on
text, greedy allocation under a bits/value budget, the plan in the calibration file)."""

import json
import warnings

import pytest
import torch

from calibration import calibrate
from calibration.budget import allocate, choose_rotate, measure_sensitivities, needle_floors, plan_bits_per_value
from conftest import make_model
from qcache import layout
from qcache.presets import recipe
from qcache import QuantCache, QuantCacheConfig
from qcache.calibfile import load_calibration
from test_cache import generate, prompt

OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2, rotate="v")


# --- options and the cache -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(layer_bits=[[4, 5]]), r"layer_bits\[0\] v_bits=5 is not supported; allowed values: \[2, 3, 4, 8\]"),
    (dict(layer_bits=[]), r"must be a non-empty list of \(k_bits, v_bits\) pairs"),
    (dict(layer_bits=[[4, 4, 4]]), r"must be a non-empty list of \(k_bits, v_bits\) pairs"),
    (dict(layer_bits=[[4, 4]], bits=3), r"bits=3 and \['layer_bits'\] both set widths"),
])
def test_bad_layer_bits_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        recipe(**kwargs)


def test_layer_bits_build_per_layer_codecs_and_count_their_bytes():
    model = make_model("llama")  # 2 layers
    cache = QuantCache(layer_bits=[[4, 2], [2, 3]], window_bits=16, **OPTS)  # "packed": the quantized tokens only
    generate(model, prompt(70), cache, max_new_tokens=3)
    assert [(lay.k_codec.bits, lay.v_codec.bits) for lay in cache.layers] == [(4, 2), (2, 3)]
    packed = [lay.store.nbytes()["packed"] for lay in cache.layers]
    tokens = cache.layers[0].quantized_length
    assert packed == [2 * tokens * 32 * (4 + 2) // 8, 2 * tokens * 32 * (2 + 3) // 8]  # 2 heads x head_dim 32
    cfg = cache.options
    assert QuantCacheConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.mean_bits() == pytest.approx(11 / 4)
    both = layout.bytes_per_token(cfg, 2, 2, 32, 1000)
    assert both == pytest.approx(layout.bytes_per_token(cfg.for_layer(0), 1, 2, 32, 1000)
                                 + layout.bytes_per_token(cfg.for_layer(1), 1, 2, 32, 1000))


def test_layer_bits_for_another_number_of_layers_raise():
    model = make_model("llama")
    with pytest.raises(ValueError, match=r"layer_bits holds 3 .* pairs but the model has 2 layers"):
        generate(model, prompt(20), QuantCache(layer_bits=[[4, 4]] * 3, **OPTS), max_new_tokens=1)


# --- allocation ------------------------------------------------------------------------------------------------------

def _toy_sensitivities(layers, scale):
    """Losses that fall 5x per bit, layer i weighing scale[i]."""
    return {(i, s, w): scale[i] * (1.0 if s == "k" else 0.5) * 5.0 ** -(w - 2)
            for i in range(layers) for s in "kv" for w in (2, 3, 4)}


def test_allocation_spends_bits_on_the_sensitive_layers_within_the_budget():
    opts = QuantCacheConfig(recent_tokens=0, sink_tokens=0)
    sens = _toy_sensitivities(4, [10.0, 1.0, 1.0, 0.1])
    quantized = [0, 1, 2, 3]
    for budget in (2.6, 3.0, 3.5, 4.0, 4.5):
        plan = allocate(sens, opts, budget, 4, quantized, kv_heads=2, head_dim=64, context=4096)
        assert plan_bits_per_value(opts, plan, quantized, 2, 64, 4096) <= budget
        assert plan[0] >= plan[3]  # the sensitive layer is never narrower than the insensitive one
        assert plan[0][0] >= plan[0][1]  # its keys (twice the loss) never narrower than its values
    assert allocate(sens, opts, 9.0, 4, quantized, 2, 64, 4096) == ((4, 4),) * 4
    # native (not quantized) layers keep the narrowest pair and cost nothing
    assert allocate(sens, opts, 3.0, 4, [0, 2], 2, 64, 4096)[1] == (2, 2)


def test_allocation_under_the_narrowest_plan_raises():
    opts = QuantCacheConfig(recent_tokens=0, sink_tokens=0)
    with pytest.raises(ValueError, match=r"budget 2.2 bits/value is below the narrowest plan \(2-bit keys and "
                                         r"values: 2.25"):
        allocate(_toy_sensitivities(2, [1, 1]), opts, 2.2, 2, [0, 1], 2, 64, 4096)


def test_allocation_starts_from_the_needle_floors():
    opts = QuantCacheConfig(recent_tokens=0, sink_tokens=0)
    sens = _toy_sensitivities(4, [10.0, 1.0, 1.0, 0.1])
    quantized = [0, 1, 2, 3]
    free = allocate(sens, opts, 3.5, 4, quantized, 2, 64, 4096)
    floored = allocate(sens, opts, 3.5, 4, quantized, 2, 64, 4096, floors={(3, "k"): 8, (2, "v"): 3})
    assert free[3][0] < 8 and floored[3][0] == 8 and floored[2][1] >= 3  # the floors hold, 8 bits included
    assert plan_bits_per_value(opts, floored, quantized, 2, 64, 4096) <= 3.5
    assert floored[0] < free[0]  # the floors' bits come out of the rest
    with pytest.raises(ValueError, match=r"below the narrowest plan \(with the needle floors: "):
        allocate(sens, opts, 2.5, 4, quantized, 2, 64, 4096, floors={(l, "k"): 4 for l in range(4)})


def test_needle_floors_are_measured_per_layer_and_stream():
    """On a tiny model (random weights: every stream matters), each (layer, stream) gets the narrowest width whose
    needle loss is within the threshold, or 8; a huge threshold leaves every stream at 2 bits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_doctor import space_letter_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=284, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         max_position_embeddings=1024, initializer_range=0.2)).eval()
    tok = space_letter_tokenizer()
    text = " ".join(["the quiet river ran past the old mill and on into the town."] * 60)
    floors, losses = needle_floors(model, tok, text, QuantCacheConfig(**OPTS), [0, 1], threshold=1e-6, length=256,
                                   count=3, progress=False)
    assert set(floors) == {(i, s) for i in (0, 1) for s in "kv"}
    for (layer, stream), w in floors.items():
        measured = [ww for (la, st, ww) in losses if (la, st) == (layer, stream)]
        assert measured == [x for x in (2, 3, 4) if x <= min(w, 4)]  # measured up to the floor, then stopped
        assert w == 8 or losses[(layer, stream, w)] <= 1e-6
    assert any(w > 2 for w in floors.values())
    relaxed, _ = needle_floors(model, tok, text, QuantCacheConfig(**OPTS), [0, 1], threshold=1e9, length=256,
                               count=3, progress=False)
    assert set(relaxed.values()) == {2}
    with pytest.raises(ValueError, match="threshold=0 must be > 0"):
        needle_floors(model, tok, text, QuantCacheConfig(**OPTS), [0, 1], threshold=0, length=256, count=3)


# --- measurement and the calibration file ------------------------------------------------------------------------------

def test_sensitivities_are_measured_per_layer_stream_and_width():
    model = make_model("llama")
    ids = torch.randint(2, 96, (1, 96), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():  # the model is handed the cache as `cache=`, not the deprecated keyword
        warnings.simplefilter("error", FutureWarning)
        sens, base = measure_sensitivities(model, ids, QuantCacheConfig(**OPTS), [0, 1], chunk=32, progress=False)
    assert set(sens) == {(i, s, w) for i in (0, 1) for s in "kv" for w in (2, 3, 4)}
    assert base >= 0 and all(v >= 0 for v in sens.values())
    # narrower codes lose more: summed over layers and streams
    total = {w: sum(v for (_, _, ww), v in sens.items() if ww == w) for w in (2, 3, 4)}
    assert total[2] > total[3] > total[4], total


def test_cli_stores_the_plan(tmp_path, monkeypatch):
    from calibration import cli

    model = make_model("llama")

    class WordTokenizer:
        def __call__(self, text, add_special_tokens=False, return_tensors=None):
            return {"input_ids": torch.tensor([[2 + hash(w) % 90 for w in text.split()]])}

    monkeypatch.setattr("qcache.tools.models.load_model", lambda name, dtype=None: (model, WordTokenizer()))
    text = tmp_path / "data.txt"
    text.write_text(" ".join(f"w{i % 300}" for i in range(2000)))
    out = tmp_path / "plan.safetensors"
    args = ["--model", "tiny", "--data", str(text), "--samples", "2", "--seq-len", "64", "--out", str(out),
            "--bits-per-value", "5.3", "--context", "8192", "--sensitivity-len", "96", "--rotation-len", "96",
            "--option", "k_group_size=16",
            "--option", "rotation=hadamard", "--option", "codebooks=false"]
    assert cli.main(args) == 0
    data = load_calibration(out)
    plan = data.options["layer_bits"]
    assert len(plan) == 2 and data.options["rotation"] == "hadamard" and data.options["k_group_size"] == 16
    assert data.settings["plan_bits_per_value"] <= 5.3 and len(data.settings["layer_sensitivities"]) == 12
    cache = QuantCache.from_calibration(out)
    generate(model, prompt(40), cache, max_new_tokens=2)
    assert [[lay.k_codec.bits, lay.v_codec.bits] for lay in cache.layers] == [list(p) for p in plan]
    # the file's codebooks are sized per layer
    assert [data.layers[i]["k_codebook"].numel() for i in (0, 1)] == [2 ** p[0] for p in plan]


def test_cli_refuses_options_that_refuse_the_files_codebooks(tmp_path, capsys):
    from calibration import cli

    with pytest.raises(SystemExit):
        cli.main(["--out", str(tmp_path / "x.safetensors"), "--option", "rotate=kv", "--option",
                  "codebooks=true"])  # both streams rotated: no stream left for the file's codebooks
    assert "refuse its codebooks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--out", str(tmp_path / "x.safetensors"), "--option", "colour=blue"])
    assert "expected NAME=VALUE with NAME one of" in capsys.readouterr().err


def test_needle_haystack_length_defaults_and_is_bounded_by_the_context(tmp_path, capsys):
    from calibration import cli

    model = make_model("llama")  # max_position_embeddings 1024
    assert cli.needle_length(model, None) == min(cli.NEEDLE_FLOOR_LENGTH, 1024)
    assert cli.needle_length(model, 512) == 512
    for bad in (0, 4096):
        with pytest.raises(ValueError, match=rf"needle_length={bad} tokens: allowed 1 to the model's context, 1024"):
            cli.needle_length(model, bad)
    with pytest.raises(SystemExit):
        cli.main(["--out", str(tmp_path / "x.safetensors"), "--needle-length", "4096"])
    assert "--needle-length=4096 is the haystack of --needle-floor" in capsys.readouterr().err


# --- evaluation specs ----------------------------------------------------------------------------------------------

def test_eval_spec_with_a_budget_calibrates_and_labels_itself(monkeypatch):
    from eval import compare
    from eval.compare import CacheSpec
    from eval.options import parse_cache_options

    spec = CacheSpec.parse("quant::calibration=auto,bits_per_value=3.5,rotation=hadamard,codebooks=false")
    assert spec.label == "quant-3.5bpv(calibration=auto,codebooks=false,rotation=hadamard)"
    assert parse_cache_options(spec.options)[1]["bits_per_value"] == 3.5
    with pytest.raises(ValueError, match=r"bits_per_value='x' must be a number"):
        parse_cache_options({"bits_per_value": "x"})
    with pytest.raises(ValueError, match=r"bits_per_value=3.5 needs calibration=auto"):
        compare.auto_calibration(None, None, CacheSpec.parse("quant::bits_per_value=3.5"))
    seen = {}

    def fake_calibrate(model, tokenizer, config, name, progress=True, budget=None, choose_rotation=False,
                       try_levels=True):
        seen.update(config=config, budget=budget, choose_rotation=choose_rotation, try_levels=try_levels)
        raise RuntimeError("stop here")

    monkeypatch.setattr("calibration.cli.calibrate_model", fake_calibrate)
    with pytest.raises(RuntimeError, match="stop here"):
        compare.auto_calibration(make_model("llama"), None, spec)
    assert seen["budget"] == {"budget": 3.5, "samples": 1, "seq_len": 2048, "context": 1024,
                              "needle_floor": None, "needle_length": None}
    assert seen["config"].rotation == "hadamard" and not seen["config"].codebooks
    assert seen["choose_rotation"]  # no rotate= in the spec: the calibration measures whether keys rotate too
    with pytest.raises(RuntimeError, match="stop here"):
        compare.auto_calibration(make_model("llama"), None, CacheSpec.parse("quant:3:calibration=auto,rotate=v"))
    assert not seen["choose_rotation"] and seen["budget"] is None
    with pytest.raises(RuntimeError, match="stop here"):
        compare.auto_calibration(make_model("llama"), None, CacheSpec.parse(
            "quant::calibration=auto,bits_per_value=3.5,needle_floor=0.2,needle_length=512"))
    assert seen["budget"]["needle_floor"] == 0.2 and seen["budget"]["needle_length"] == 512
    with pytest.raises(ValueError, match=r"needle_length=512 is the haystack the needle floors"):
        compare.auto_calibration(None, None, CacheSpec.parse("quant::calibration=auto,bits_per_value=3.5,"
                                                             "needle_length=512"))
    with pytest.raises(ValueError, match=r"needle_length=.x. must be an integer"):
        parse_cache_options({"needle_length": "x"})


def test_eval_spec_gives_widths_layer_by_layer():
    from eval.compare import CacheSpec
    from eval.options import format_layer_bits, parse_cache_options, parse_layer_bits
    from eval.caches import cache_factory

    spec = CacheSpec.parse("quant::layer_bits=k4v2+k8v3,window_bits=16")
    assert spec.label == "quant-layers(layer_bits=k4v2+k8v3,window_bits=16)"
    assert spec.nominal_bits == (4 + 2 + 8 + 3) / 4
    bits, parsed = parse_cache_options(spec.options)
    assert bits is None and parsed["layer_bits"] == ((4, 2), (8, 3))
    model = make_model("llama")  # 2 layers
    cache = cache_factory("quant", model.config, None, **parsed, **OPTS)()
    generate(model, prompt(40), cache, max_new_tokens=1)
    assert [(lay.k_codec.bits, lay.v_codec.bits) for lay in cache.layers] == [(4, 2), (8, 3)]
    plan = ((3, 3),) * 18 + ((8, 3),) + ((3, 3),) * 11
    assert format_layer_bits(plan) == "k3v3x18+k8v3+k3v3x11" and parse_layer_bits(format_layer_bits(plan)) == plan
    assert QuantCacheConfig(layer_bits="k4v2+k8v3").layer_bits == ((4, 2), (8, 3))  # QuantCache(layer_bits="...")
    for bad in ("k4v2x0", "k4+k8v3", "4/2", ""):
        with pytest.raises(ValueError, match=r"is not a run of layers; allowed: k<K>v<V> \(one layer\) or k<K>v<V>x<N>"):
            parse_layer_bits(bad)
    with pytest.raises(ValueError, match=r"layer_bits\[1\] v_bits=5 is not supported"):
        cache_factory("quant", make_model("llama").config, None, **parse_cache_options({"layer_bits": "k4v2+k4v5"})[1])
    with pytest.raises(ValueError, match=r"layer_bits and k_bits both set widths; allowed: one of them"):
        parse_cache_options({"layer_bits": "k4v2x2", "k_bits": "4"})


def test_choose_rotate_keeps_the_lower_kl_and_resolves_the_rest():
    model = make_model("llama")
    ids = torch.randint(2, 96, (1, 96), generator=torch.Generator().manual_seed(4))
    opts = recipe(bits=2, k_group_size=16, recent_tokens=4, sink_tokens=2)
    chosen, kls = choose_rotate(model, ids, opts, chunk=32)
    assert set(kls) == {"v", "kv", "kv+lloyd-max"} and len(set(kls.values())) == 3
    best = min(kls, key=kls.get)
    # "v" is the 2-bit default: unrotated keys on Lloyd-Max levels; "kv" rotated keys on uniform levels
    assert (chosen.rotate, chosen.levels) == {"v": ("v", "lloyd-max"), "kv": ("kv", "uniform"),
                                              "kv+lloyd-max": ("kv", "lloyd-max")}[best]
    assert chosen.v_scale == "norm" and not chosen.codebooks  # no codebooks: Lloyd-Max or rotated keys
    # levels given (try_levels=False): both choices keep the options' levels, here Lloyd-Max
    _, two = choose_rotate(model, ids, opts, chunk=32, try_levels=False)
    assert two == {"v": kls["v"], "kv": kls["kv+lloyd-max"]}
    three = recipe(bits=3, k_group_size=16, recent_tokens=4, sink_tokens=2)
    chosen3, kls3 = choose_rotate(model, ids, three, chunk=32)
    assert chosen3.levels == ("lloyd-max" if min(kls3, key=kls3.get) == "kv+lloyd-max" else "uniform")
    with pytest.raises(ValueError, match="needs rotation='hadamard'"):
        choose_rotate(model, ids, recipe(bits=2, rotation="none", rotate="kv", v_scale="minmax"))


def test_calibration_stores_the_rotation_choice():
    model = make_model("llama")
    ids = torch.randint(2, 96, (2, 64), generator=torch.Generator().manual_seed(5))
    sens = torch.randint(2, 96, (1, 96), generator=torch.Generator().manual_seed(6))
    opts = recipe(bits=2, k_group_size=16, recent_tokens=4, sink_tokens=2)
    data = calibrate(model, ids, opts, {}, progress=False, sensitivity_ids=sens, choose_rotation=True)
    kls = data.settings["rotate_kl"]
    best = min(kls, key=kls.get)
    assert data.options["rotate"] == best.split("+")[0]
    with pytest.raises(ValueError, match="needs the sequences to measure on"):
        calibrate(model, ids, opts, {}, progress=False, choose_rotation=True)


def test_rotation_choice_is_measured_at_the_models_full_context(monkeypatch):
    """calibrate_model sizes the rotation measurement by the model's maximum context unless told otherwise."""
    from calibration.cli import calibrate_model

    model = make_model("llama")  # max_position_embeddings 1024

    class WordTokenizer:
        def __call__(self, text, add_special_tokens=False, return_tensors=None):
            return {"input_ids": torch.tensor([[2 + int(w[1:]) % 90 for w in text.split()]])}

    seen = {}

    def fake_choose(model, ids, options, reference=None, try_levels=True):
        seen["shape"] = tuple(ids.shape)
        return options, {"v": 0.0}

    monkeypatch.setattr("calibration.run.choose_rotate", fake_choose)
    monkeypatch.setattr("qcache.tools.data.read_split", lambda name: " ".join(f"w{i}" for i in range(5000)))
    opts = recipe(bits=3, k_group_size=16)
    data = calibrate_model(model, WordTokenizer(), opts, "tiny", samples=2, seq_len=32, progress=False,
                           choose_rotation=True)
    assert seen["shape"] == (1, 1024) and data.settings["rotate_tokens"] == 1024
    calibrate_model(model, WordTokenizer(), opts, "tiny", samples=2, seq_len=32, progress=False,
                    choose_rotation=True, rotation_measure=(2, 128))
    assert seen["shape"] == (2, 128)


def test_cli_sensitivity_flags_need_a_budget(capsys):
    from calibration import cli

    with pytest.raises(SystemExit):
        cli.main(["--model", "tiny", "--out", "x.safetensors", "--sensitivity-len", "96"])
    assert "--sensitivity-samples/--sensitivity-len size the per-layer measurement of --bits-per-value" in \
        capsys.readouterr().err
