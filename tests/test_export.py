"""python -m qcache.tools.export vllm: fp8 KV-cache scales as vLLM / compressed-tensors checkpoints carry them.

Tiny random models (conftest) saved to a temporary directory and calibrated on random ids. The K/V that attention
really reads (after RoPE) are recorded with an attention function registered through transformers' attention
interface, and quantized to fp8 e4m3 and back with the exported scales: nothing saturates, every error is within
the e4m3 rounding bound, and the error RMS is the one predicted for 3 mantissa bits.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from calibration import calibrate, collect_statistics
from conftest import make_model
from qcache.presets import recipe
from qcache.calibfile import CalibrationData, load_calibration, save_calibration
from qcache.tools.export import (FP8_E4M3_MAX, SCALES_FILE, ExportOptions, export_vllm, fp8_scales, kv_cache_scheme,
                           main, quantization_config)

OPTS = dict(k_group_size=16, v_group_size=16, v_scale="minmax", recent_tokens=4, sink_tokens=2)
FAMILIES = ("llama", "gemma3")  # GQA with full attention; MQA with sliding + full layers
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_STEP = 2.0**-9


def calibration_ids(seed=5):
    return torch.randint(2, 96, (3, 64), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tmp_path_factory):
    """(family, model, model directory, calibration file)."""
    model = make_model(request.param)
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "model")
    data = calibrate(model, calibration_ids(), recipe(bits=4, **OPTS), {"data_source": "random ids"},
                     progress=False)
    return request.param, model, root / "model", save_calibration(root / "calib.safetensors", data)


def record_kv(model, ids) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """{layer: (keys, values)} [B, H, T, D] as the attention function receives them (keys after RoPE)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    seen = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (key.detach().clone(), value.detach().clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("test_record_kv", recording)
    AttentionMaskInterface.register("test_record_kv", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    previous = model.config._attn_implementation
    model.set_attn_implementation("test_record_kv")
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return seen


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What vLLM stores and reads back: x / scale, saturated to e4m3's range, cast, times scale (fp32 math)."""
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


def per_head(scale: torch.Tensor, heads: int) -> torch.Tensor:
    """[1] or [H, 1, 1] scale -> broadcastable over [B, H, T, D]."""
    return scale.view(1, -1, 1, 1).expand(1, heads, 1, 1)


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_names_shapes_dtypes_and_config(setup, tmp_path, strategy):
    family, model, model_dir, calib = setup
    out = export_vllm(model_dir, calib, tmp_path / "out", ExportOptions(strategy))
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    original = load_file(model_dir / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    scale_names = {f"model.layers.{i}.self_attn.{kv}_scale" for i in range(layers) for kv in "kv"}
    assert set(exported) == set(original) | scale_names
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())  # weights untouched
    shape = (1,) if strategy == "tensor" else (heads, 1, 1)
    for name in scale_names:
        assert exported[name].shape == shape and exported[name].dtype == torch.float32, name
        assert bool((exported[name] > 0).all())
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["config_groups"] == {}
    assert config["quantization_config"]["kv_cache_scheme"] == {
        "num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}
    assert {k: v for k, v in config.items() if k != "quantization_config"} == json.loads(
        (model_dir / "config.json").read_text())
    provenance = json.loads((out / "qcache-kv-scales.json").read_text())
    assert provenance["strategy"] == strategy and len(provenance["calibration_sha256"]) == 64
    assert provenance["vllm"][0] == f"vllm serve {out} --kv-cache-dtype fp8" + (
        " (per-head scales need the FlashAttention backend)" if strategy == "attn_head" else "")


def test_scales_cover_the_post_rope_ranges(setup, tmp_path):
    """k_scale * 448 is the largest |key| attention read (after RoPE) per layer and head; not the pre-RoPE one."""
    family, model, model_dir, calib = setup
    out = export_vllm(model_dir, calib, tmp_path / "out", ExportOptions("attn_head"))
    scales = load_file(out / "model.safetensors")
    recorded = record_kv(model, calibration_ids())
    pre_rope = collect_statistics(model, calibration_ids(), progress=False)
    differs = 0
    for i, (keys, values) in recorded.items():
        k_max = keys.abs().amax(dim=(0, 2, 3))  # [B, H, T, D] -> [H]
        v_max = values.abs().amax(dim=(0, 2, 3))
        covered = FP8_E4M3_MAX / ExportOptions().headroom  # the calibrated range, without the default headroom
        torch.testing.assert_close(scales[f"model.layers.{i}.self_attn.k_scale"].flatten() * covered, k_max,
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(scales[f"model.layers.{i}.self_attn.v_scale"].flatten() * covered, v_max,
                                   rtol=1e-5, atol=0)
        pre_max = pre_rope[i]["keys"].abs().amax(dim=(1, 2))  # [H, N, D] -> [H]
        differs += int(not torch.allclose(pre_max, k_max, rtol=1e-3))
    assert differs > 0  # RoPE changes the range: a pre-RoPE scale would be wrong


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_fp8_round_trip_error_is_as_predicted(setup, tmp_path, strategy):
    """Quantize the recorded K/V with the exported scales: no saturation; |error| <= half an e4m3 step
    (2**-4 |x| for normal numbers, 2**-10 * scale below 2**-6 * scale); and the relative RMS error of normal numbers
    is what round-to-nearest with 3 mantissa bits gives for mantissas spread log-uniformly (Benford):
    2**-3 * sqrt(E[1/m^2] / 12) with E[1/m^2] = 3 / (8 ln 2) for m in [1, 2): 2.65 %."""
    family, model, model_dir, calib = setup
    out = export_vllm(model_dir, calib, tmp_path / "out", ExportOptions(strategy))
    scales = load_file(out / "model.safetensors")
    predicted_rms = 2.0**-E4M3_MANTISSA_BITS * math.sqrt(3 / (8 * math.log(2)) / 12)
    rel_sq, normal_count = 0.0, 0
    for i, (keys, values) in record_kv(model, calibration_ids()).items():
        for kv, x in (("k", keys), ("v", values)):
            scale = per_head(scales[f"model.layers.{i}.self_attn.{kv}_scale"], x.shape[1])
            scaled = x.float() / scale
            assert float(scaled.abs().max()) <= FP8_E4M3_MAX * (1 + 1e-5)  # the calibrated range covers it
            err = (fp8_round_trip(x, scale) - x.float()).abs()
            bound = torch.maximum(x.float().abs() * 2.0**-(E4M3_MANTISSA_BITS + 1),
                                  scale * E4M3_SUBNORMAL_STEP / 2)
            assert bool((err <= bound * (1 + 1e-5) + 1e-12).all()), f"layer {i} {kv}"
            normal = scaled.abs() >= E4M3_MIN_NORMAL
            rel_sq += float(((err / x.float().abs())[normal] ** 2).sum())
            normal_count += int(normal.sum())
    measured_rms = math.sqrt(rel_sq / normal_count)
    assert normal_count > 10_000
    assert abs(measured_rms / predicted_rms - 1) < 0.05, (measured_rms, predicted_rms)


@pytest.mark.parametrize("headroom, saturates", [(2.0, False), (4.0, False), (0.5, True)])
def test_headroom_is_free_in_range(setup, headroom, saturates):
    """A power-of-two headroom rounds every value that stays a normal e4m3 number exactly as headroom 1 does; the
    calibrated range itself never saturates with headroom >= 1 (0.5 is below the allowed 1, built by hand)."""
    family, model, model_dir, calib = setup
    data = load_calibration(calib)
    for i, (keys, values) in record_kv(model, calibration_ids()).items():
        for x, name in ((keys, "k_absmax"), (values, "v_absmax")):
            base = per_head(fp8_scales(data.kv_ranges[name], "attn_head")[i], x.shape[1])
            scaled = per_head(data.kv_ranges[name][i] * headroom / FP8_E4M3_MAX, x.shape[1])
            normal = (x.float() / scaled).abs() >= E4M3_MIN_NORMAL
            same = fp8_round_trip(x, scaled)[normal] == fp8_round_trip(x, base)[normal]
            assert bool(same.all()) != saturates
    if saturates:
        with pytest.raises(ValueError, match="headroom=0.5 must be a finite number >= 1"):
            ExportOptions(headroom=headroom)


def test_fp8_scales_layouts():
    absmax = torch.tensor([[1.0, 4.0], [0.0, 0.0]])  # [L, H]; the second layer saw only zeros
    tensor, head = fp8_scales(absmax, "tensor"), fp8_scales(absmax, "attn_head")
    assert torch.equal(fp8_scales(absmax, "tensor", headroom=2.0)[0], 2 * tensor[0])
    assert [t.shape for t in tensor] == [(1,), (1,)] and [t.shape for t in head] == [(2, 1, 1), (2, 1, 1)]
    assert torch.equal(tensor[0], torch.tensor([4.0]) / 448)
    assert torch.equal(head[0].flatten(), torch.tensor([1.0, 4.0]) / 448)
    assert float(tensor[1]) == torch.finfo(torch.float32).tiny  # positive, as vLLM requires; 0 still maps to 0
    with pytest.raises(ValueError, match="finite, >= 0"):
        fp8_scales(torch.tensor([[float("nan"), 1.0]]), "tensor")


def test_sharded_checkpoint_gets_a_scales_shard(tmp_path):
    model = make_model("llama")
    model.save_pretrained(tmp_path / "model", max_shard_size="60KB")
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    data = calibrate(model, calibration_ids(), recipe(bits=4, **OPTS), {}, progress=False)
    out = export_vllm(tmp_path / "model", data, tmp_path / "out")
    new_index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {k: v for k, v in new_index["weight_map"].items() if v != SCALES_FILE} == index["weight_map"]
    assert sorted(k for k, v in new_index["weight_map"].items() if v == SCALES_FILE) == sorted(
        f"model.layers.{i}.self_attn.{kv}_scale" for i in range(2) for kv in "kv")
    for name, file in new_index["weight_map"].items():  # every entry is in the file the index names
        assert name in load_file(out / file)


def test_refusals(setup, tmp_path):
    family, model, model_dir, calib = setup
    data = load_calibration(calib)
    old = CalibrationData(data.model, data.options, data.settings, data.layers, data.qcache_version, "old.safetensors")
    with pytest.raises(ValueError, match=r"has no K/V ranges \(format_version 1.*python -m qcache.calibrate"):
        export_vllm(model_dir, old, tmp_path / "a")
    other = make_model("qwen3")
    other.save_pretrained(tmp_path / "qwen3")
    with pytest.raises(ValueError, match="was made for another model"):
        export_vllm(tmp_path / "qwen3", calib, tmp_path / "b")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        export_vllm(model_dir, calib, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind
    with pytest.raises(ValueError, match=r"strategy='channel' is not supported; allowed values: \['tensor', "
                                         r"'attn_head'\]"):
        ExportOptions("channel")


@pytest.mark.parametrize("existing, match", [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method='gptq'; allowed: none or 'compressed-tensors'"),
    ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}}, "already has a kv_cache_scheme"),
])
def test_quantization_config_refuses(existing, match):
    with pytest.raises(ValueError, match=match):
        quantization_config("tensor", existing)


def test_quantization_config_keeps_quantized_weights():
    existing = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {}}}
    merged = quantization_config("attn_head", existing)
    assert merged == {**existing, "kv_cache_scheme": kv_cache_scheme("attn_head")}


def test_cli(setup, tmp_path, capsys):
    family, model, model_dir, calib = setup
    assert main(["vllm", "--model", str(model_dir), "--calibration", str(calib), "--out", str(tmp_path / "o"),
                 "--strategy", "attn_head"]) == 0
    printed = capsys.readouterr().out
    assert f"vllm serve {tmp_path / 'o'} --kv-cache-dtype fp8" in printed and "kv_cache_dtype='fp8'" in printed
    with pytest.raises(SystemExit):
        main(["vllm", "--model", str(model_dir), "--calibration", str(calib), "--out", "x", "--strategy", "channel"])


def test_compressed_tensors_reads_the_scheme_and_layout():
    """Where compressed-tensors is installed: its own schema accepts the config, and the scales it would create for
    this scheme have our shapes and dtype."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams

    for strategy, shape in (("tensor", (1,)), ("attn_head", (3, 1, 1))):
        config = QuantizationConfig.model_validate(quantization_config(strategy))
        assert config.kv_cache_scheme.strategy == strategy and config.kv_cache_scheme.type == "float"
        module = torch.nn.Linear(2, 2)
        args = QuantizationArgs.model_validate(kv_cache_scheme(strategy))
        initialize_qparams(module, "k", args, observed_shape=(3, None, 64), observed_dtype=torch.float32,
                           force_zero_point=False)
        assert module.k_scale.shape == shape and module.k_scale.dtype == torch.float32, ct.__version__
        assert tuple(fp8_scales(torch.ones(1, 3), strategy)[0].shape) == shape
