"""python -m qcache.tools.export vllm: fp8 KV-cache scales for vLLM from a calibration file.

    python -m qcache.tools.export vllm --model smollm2-135m --calibration smollm2.qcache.safetensors --out smollm2-fp8kv
    python -m qcache.tools.export vllm --model ./my-hf-dir --calibration org/my-calibration --out out --strategy attn_head
    vllm serve smollm2-fp8kv --kv-cache-dtype fp8

writes a model directory the way llm-compressor / compressed-tensors checkpoints carry fp8 KV-cache scales:

    <out>/config.json                 the model's, plus quantization_config = {quant_method: compressed-tensors,
                                      format: dense, config_groups: {}, kv_cache_scheme: {num_bits: 8,
                                      type: float, strategy: tensor | attn_head, dynamic: false, symmetric: true}}
    <out>/model.safetensors           the model's tensors, unchanged, plus per attention layer i
                                          model.layers.{i}.self_attn.k_scale   float32 [1] (tensor) or
                                          model.layers.{i}.self_attn.v_scale   [num_kv_heads, 1, 1] (attn_head)
                                      (a sharded checkpoint keeps its shards and gets kv_cache_scales.safetensors
                                      plus entries in model.safetensors.index.json)
    <out>/qcache-kv-scales.json       where the scales came from: calibration file and sha256, ranges, scales
    <out>/...                         every other file of the model directory (tokenizer, generation config)

The scale of a tensor is what vLLM divides by before casting to fp8 e4m3 (and multiplies by after):
headroom x the largest |value| the calibration run saw / 448 (e4m3's largest finite value), per layer (tensor) or per
layer and KV head (attn_head). vLLM writes keys into its cache after RoPE, so the key ranges are those of post-RoPE
keys, which the calibration run records (`k_absmax` / `v_absmax` in the calibration file, format 2; an older file
has none and is refused with the command that makes a new one).

What the fp8 round trip then costs, for a value x within the range: e4m3 keeps 3 mantissa bits, so
|fp8(x / s) * s - x| <= 2**-4 * |x| where |x| / s >= 2**-6 (normal numbers) and <= 2**-10 * s below (subnormals);
values beyond 448 * s saturate there in vLLM's conversion, and text the calibration never saw does go beyond the
calibrated range, where saturating costs far more than rounding. Hence `headroom=2` by default: a power of two
rounds every value in range exactly as headroom 1 does (one binade more on top, one fewer at the bottom, where
only values below 1/14336 of the calibrated range lose relative precision).

Example:
    >>> export_vllm("smollm2-135m", "smollm2.qcache.safetensors", "smollm2-fp8kv")   # doctest: +SKIP
    PosixPath('smollm2-fp8kv')
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import file_sha256

__all__ = ["FP8_E4M3_MAX", "STRATEGIES", "ExportOptions", "kv_cache_scheme", "quantization_config", "fp8_scales",
           "attention_prefixes", "export_vllm", "vllm_commands", "main"]

logger = logging.getLogger(__name__)

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
STRATEGIES = ("tensor", "attn_head")
SCALES_FILE = "kv_cache_scales.safetensors"  # the extra shard of a sharded checkpoint
PROVENANCE_FILE = "qcache-kv-scales.json"
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
_SKIPPED = ("config.json", "qcache-converted.json", _SINGLE, _INDEX)  # rewritten, or a marker of qcache's model cache
_PROJECTION = re.compile(r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.[^.]+)\.(?:k_proj|qkv_proj)\.weight$")


@dataclass(frozen=True)
class ExportOptions:
    """How the scales are laid out and sized.

    Args:
        strategy: "tensor" (one k_scale and one v_scale per layer, what every vLLM attention backend reads) or
            "attn_head" (one per layer and KV head; vLLM reads it with the FlashAttention backend).
        headroom: the range covered, as a multiple of the calibrated one (>= 1; see the module docstring for why
            the default is 2).

    Example:
        >>> ExportOptions(strategy="attn_head").strategy
        'attn_head'
    """

    strategy: str = "tensor"
    headroom: float = 2.0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not supported; allowed values: {list(STRATEGIES)}")
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, (int, float)) or not (
                math.isfinite(self.headroom) and self.headroom >= 1):
            raise ValueError(f"headroom={self.headroom!r} must be a finite number >= 1")


def kv_cache_scheme(strategy: str) -> dict:
    """compressed-tensors' kv_cache_scheme entry for static symmetric fp8 (e4m3) scales."""
    ExportOptions(strategy)
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}


def quantization_config(strategy: str, existing: dict | None = None) -> dict:
    """The model's quantization_config with our kv_cache_scheme: a new KV-cache-only compressed-tensors config, or
    the model's own compressed-tensors config (quantized weights) with the scheme added."""
    scheme = kv_cache_scheme(strategy)
    if existing is None:
        return {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
                "config_groups": {}, "ignore": [], "kv_cache_scheme": scheme}
    if existing.get("quant_method") != "compressed-tensors":
        raise ValueError(f"the model already has quantization_config with quant_method="
                         f"{existing.get('quant_method')!r}; allowed: none or 'compressed-tensors'")
    if existing.get("kv_cache_scheme") is not None:
        raise ValueError(f"the model's quantization_config already has a kv_cache_scheme "
                         f"({existing['kv_cache_scheme']}); allowed: a model without one")
    return {**existing, "kv_cache_scheme": scheme}


def fp8_scales(absmax: torch.Tensor, strategy: str, headroom: float = 1.0) -> list[torch.Tensor]:
    """[L, H] ranges -> one float32 scale tensor per layer: [1] (tensor) or [H, 1, 1] (attn_head),
    headroom * absmax / 448.

    A range of 0 (a head whose values were all 0) gets the smallest positive float32, so vLLM's check for
    positive scales holds and 0 still maps to 0."""
    ExportOptions(strategy, headroom)
    if absmax.dim() != 2 or not bool(torch.isfinite(absmax).all()) or bool((absmax < 0).any()):
        raise ValueError(f"ranges must be finite, >= 0, of shape [layers, kv_heads]; got {list(absmax.shape)}")
    tiny = torch.finfo(torch.float32).tiny
    covered = absmax.float() * headroom
    if strategy == "tensor":
        per_layer = covered.amax(dim=1, keepdim=True)  # [L, 1]
        return [(row / FP8_E4M3_MAX).clamp(min=tiny) for row in per_layer]
    # [L, H] -> [L, H, 1, 1]: compressed-tensors' per-head layout (vLLM flattens it to [num_kv_heads])
    return [(row / FP8_E4M3_MAX).clamp(min=tiny) for row in covered[:, :, None, None]]


def _weight_names(model_dir: Path) -> dict[str, str]:
    """{tensor name: file name} of a safetensors checkpoint (names only; no tensor is read)."""
    from safetensors import safe_open

    if (model_dir / _INDEX).is_file():
        return dict(json.loads((model_dir / _INDEX).read_text())["weight_map"])
    if (model_dir / _SINGLE).is_file():
        with safe_open(str(model_dir / _SINGLE), framework="pt") as f:
            return {name: _SINGLE for name in f.keys()}
    raise ValueError(f"{model_dir} has neither {_SINGLE} nor {_INDEX}; allowed: a safetensors checkpoint")


def attention_prefixes(names, num_layers: int) -> list[str]:
    """The attention module of each layer, as the checkpoint names it (the owner of k_proj / qkv_proj), in layer
    order, e.g. 'model.layers.3.self_attn'."""
    found: dict[int, str] = {}
    for name in names:
        if (m := _PROJECTION.match(name)) is not None:
            found.setdefault(int(m["layer"]), m["prefix"])
    if sorted(found) != list(range(num_layers)):
        raise ValueError(f"found attention projections (k_proj / qkv_proj) for layers {sorted(found)}, but the "
                         f"model has {num_layers}; allowed: checkpoints with one per layer")
    return [found[i] for i in range(num_layers)]


def _model_dir(model: str | os.PathLike) -> Path:
    """A local directory for a short name, a directory, or a hub id (from the local HF cache when offline)."""
    from ..hub import hub_cache_dir, is_offline
    from .models import resolve_model

    path = Path(resolve_model(model)).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(model), cache_dir=hub_cache_dir(), local_files_only=is_offline()))
    except (LocalEntryNotFoundError, HfHubHTTPError) as err:
        raise ValueError(f"model {str(model)!r} is not a local directory and could not be read from the hub "
                         f"({'offline, not cached' if is_offline() else type(err).__name__}): {err}") from err


def vllm_commands(out: str | os.PathLike, strategy: str) -> list[str]:
    """How to serve the exported directory with vLLM (fp8 KV cache with the exported scales)."""
    backend = " (per-head scales need the FlashAttention backend)" if strategy == "attn_head" else ""
    return [f"vllm serve {out} --kv-cache-dtype fp8{backend}",
            f'python -c "from vllm import LLM; LLM(model=\'{out}\', kv_cache_dtype=\'fp8\')"']


def export_vllm(model: str | os.PathLike, calibration, out: str | os.PathLike,
                options: ExportOptions | None = None) -> Path:
    """Write `out`: the model directory with fp8 KV-cache scales from `calibration` (see the module docstring).

    Args:
        model: short name, local HF directory or hub id of the model the calibration was made for.
        calibration: anything `load_calibration` takes (file, hub-like folder, hub repo id) or a CalibrationData.
        out: the directory to write; must not exist or be empty (written next to it, then renamed into place).
        options: ExportOptions (strategy).
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from ..calibfile import model_fingerprint
    from ..calibfile import CalibrationData, load_calibration

    options = options or ExportOptions()
    data = calibration if isinstance(calibration, CalibrationData) else load_calibration(calibration)
    model_dir = _model_dir(model)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    text_config = config.get_text_config(decoder=True)
    data.check_model(model_fingerprint(text_config))
    if data.kv_ranges is None:
        raise ValueError(f"calibration file {data.path or ''} has no K/V ranges (format_version 1, made before "
                         "they were recorded); make a new one: python -m qcache.calibrate --model <model> --out <file>")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} exists and is not an empty directory; allowed: a new or empty one")

    raw_config = json.loads((model_dir / "config.json").read_text())
    raw_config["quantization_config"] = quantization_config(options.strategy, raw_config.get("quantization_config"))
    names = _weight_names(model_dir)
    prefixes = attention_prefixes(names, int(text_config.num_hidden_layers))
    k_scales = fp8_scales(data.kv_ranges["k_absmax"], options.strategy, options.headroom)
    v_scales = fp8_scales(data.kv_ranges["v_absmax"], options.strategy, options.headroom)
    scales = {}
    for prefix, k, v in zip(prefixes, k_scales, v_scales):
        scales[f"{prefix}.k_scale"], scales[f"{prefix}.v_scale"] = k.contiguous(), v.contiguous()
    clash = sorted(set(scales) & set(names))
    if clash:
        raise ValueError(f"the checkpoint already holds {clash[:4]}...; allowed: a model without KV-cache scales")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        skipped = []
        for item in sorted(model_dir.iterdir()):
            if item.name in _SKIPPED:
                continue
            if item.is_dir():
                skipped.append(item.name)
                continue
            shutil.copyfile(item, tmp / item.name)  # other shards, tokenizer, generation config
        if skipped:
            logger.warning("not copied (folders): %s", skipped)
        if (model_dir / _INDEX).is_file():
            index = json.loads((model_dir / _INDEX).read_text())
            save_file(scales, str(tmp / SCALES_FILE), metadata={"format": "pt"})
            shutil.copymode(model_dir / _INDEX, tmp / SCALES_FILE)  # readable like the other files
            index["weight_map"].update({name: SCALES_FILE for name in scales})
            (tmp / _INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        else:
            from safetensors import safe_open

            with safe_open(str(model_dir / _SINGLE), framework="pt") as f:
                metadata = f.metadata() or {"format": "pt"}
            save_file({**load_file(model_dir / _SINGLE), **scales}, str(tmp / _SINGLE), metadata=metadata)
            shutil.copymode(model_dir / _SINGLE, tmp / _SINGLE)
        (tmp / "config.json").write_text(json.dumps(raw_config, indent=2, sort_keys=True) + "\n")
        provenance = {
            "calibration": data.path, "calibration_sha256": file_sha256(Path(data.path)) if data.path else None,
            "calibration_settings": data.settings, "model": str(model), "strategy": options.strategy,
            "headroom": options.headroom, "fp8": "e4m3 (float8_e4m3fn), largest finite value 448",
            "scale": "headroom * absmax / 448, keys after RoPE",
            "k_absmax": data.kv_ranges["k_absmax"].tolist(), "v_absmax": data.kv_ranges["v_absmax"].tolist(),
            "scales": {name: t.flatten().tolist() for name, t in scales.items()},
            "vllm": vllm_commands(out, options.strategy),
        }
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, default=str) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left after a successful rename
    logger.info("wrote %s: %d k/v scale pairs (%s)", out, len(prefixes), options.strategy)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qcache.tools.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    engines = p.add_subparsers(dest="engine", required=True, metavar="ENGINE", help="serving engine: vllm")
    v = engines.add_parser("vllm", help="fp8 KV-cache scales as vLLM / compressed-tensors checkpoints carry them")
    from .models import MODELS

    v.add_argument("--model", required=True, help=f"short name ({', '.join(sorted(MODELS))}), HF directory or hub id")
    v.add_argument("--calibration", required=True,
                   help="calibration file (python -m qcache.calibrate), hub-like folder or hub repo id")
    v.add_argument("--out", required=True, type=Path, help="output model directory (new or empty)")
    v.add_argument("--strategy", choices=STRATEGIES, default="tensor",
                   help="tensor: one scale per layer (every vLLM backend); attn_head: one per layer and KV head "
                        "(vLLM's FlashAttention backend)")
    v.add_argument("--headroom", type=float, default=2.0,
                   help="range covered as a multiple of the calibrated one (>= 1; default 2: same rounding, room "
                        "for text beyond the calibration's range)")
    args = p.parse_args(argv)
    try:
        options = ExportOptions(strategy=args.strategy, headroom=args.headroom)
    except ValueError as err:
        p.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = export_vllm(args.model, args.calibration, args.out, options)
    print(f"wrote {out}; serve it with vLLM (not installed here):")
    for line in vllm_commands(out, args.strategy):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
