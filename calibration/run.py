"""calibrate(): statistics -> fitted tensors -> CalibrationData (what `python -m qcache.calibrate` saves)."""

from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from qcache.cache import model_fingerprint
from qcache.calibfile import CalibrationData
from qcache.config import QuantCacheConfig

from .collect import collect_statistics
from .fit import CLIP_CANDIDATES, fit_codebook, fit_static_key_range, key_samples, value_samples

__all__ = ["calibrate", "METHOD"]

log = logging.getLogger(__name__)
METHOD = "pre-rope-minmax-groups+sensitivity-weighted-kmeans-codebooks+clipped-static-key-ranges"


def calibrate(model, input_ids: torch.Tensor, options: QuantCacheConfig, settings: dict, seed: int = 0,
              progress: bool = True) -> CalibrationData:
    """Run `model` over `input_ids` [N, L] and fit, for every full-attention layer (and sliding layers when
    `options.sliding_layers == "quantized"`): key/value codebooks for options.k_bits/v_bits and static key ranges."""
    torch.manual_seed(seed)
    text_config = model.config.get_text_config(decoder=True)
    fingerprint = model_fingerprint(text_config)
    layer_types = fingerprint["layer_types"] or ["full_attention"] * fingerprint["num_hidden_layers"]
    wanted = {i for i, t in enumerate(layer_types)
              if t == "full_attention" or (t == "sliding_attention" and options.sliding_layers == "quantized")}
    stats = collect_statistics(model, input_ids, progress=progress)
    head_dim = fingerprint["head_dim"]
    v_group = options.value_group_size(head_dim)
    layers = {}
    for idx in tqdm(sorted(wanted), desc="fit layers", disable=not progress):
        s = stats[idx]
        zero, rng = fit_static_key_range(s["keys"], options.k_bits, seed=seed)
        static_scale = rng / (2**options.k_bits - 1)
        k_u, k_w = key_samples(s["keys"], s["k_weight"], options.k_group_size,
                               static=(zero, rng) if options.static_keys else None, outliers=options.outliers)
        v_u, v_w = value_samples(s["values"], s["v_weight"], v_group, outliers=options.outliers)
        layers[idx] = {
            "k_codebook": fit_codebook(k_u, k_w, options.k_bits, seed=seed),
            "v_codebook": fit_codebook(v_u, v_w, options.v_bits, seed=seed),
            "k_channel_weight": s["k_weight"].float(),
            "k_static_zero": zero.float(),
            "k_static_scale": static_scale.float(),
        }
    settings = {**settings, "method": METHOD, "seed": seed, "k_bits": options.k_bits, "v_bits": options.v_bits,
                "clip_candidates": list(CLIP_CANDIDATES), "tokens": int(input_ids.numel())}
    return CalibrationData(fingerprint, options.to_dict(), settings, layers)
