"""calibrate(): statistics -> fitted tensors -> CalibrationData (what `python -m qcache.calibrate` saves).

Besides the per-layer codebooks and static key ranges it records the K/V ranges of every layer and KV head
(`kv_ranges`: largest |key| as attention reads it, i.e. after RoPE, and largest |value|), from which
`python -m qcache.tools.export vllm` derives fp8 KV-cache scales.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from tqdm.auto import tqdm

from qcache.cache import model_fingerprint
from qcache.calibfile import CalibrationData
from qcache.config import QuantCacheConfig
from qcache.rope import RopeHelper, has_rope

from .budget import (allocate, choose_rotate, measure_sensitivities, needle_floors, plan_bits_per_value,
                     reference_logprobs)
from .collect import collect_statistics
from .fit import CLIP_CANDIDATES, fit_codebook, fit_static_key_range, key_samples, value_samples

__all__ = ["calibrate", "kv_absmax", "METHOD"]

log = logging.getLogger(__name__)
METHOD = "pre-rope-minmax-groups+sensitivity-weighted-kmeans-codebooks+clipped-static-key-ranges"


def kv_absmax(stats: dict[int, dict[str, torch.Tensor]], text_config, seq_len: int) -> dict[str, torch.Tensor]:
    """Per layer and KV head, the largest |key| after RoPE and the largest |value| -> {"k_absmax", "v_absmax"},
    each [num_hidden_layers, num_key_value_heads].

    `stats` holds pre-RoPE keys [H, N, D] of sequences of `seq_len` tokens, one after another, at positions
    0..seq_len-1 (what `collect_statistics` records for a batch of unpadded sequences); RoPE is redone in fp32
    with the model's own rotary code, so these are the keys attention multiplied with queries."""
    layers = int(text_config.num_hidden_layers)
    missing = [i for i in range(layers) if i not in stats]
    if missing:
        raise ValueError(f"no K/V statistics for layers {missing}: every layer needs a range")
    rope = RopeHelper(text_config) if has_rope(text_config) else None
    k_max, v_max = [], []
    for idx in range(layers):
        keys, values = stats[idx]["keys"], stats[idx]["values"]  # [H, N, D]
        H, N, D = keys.shape
        if N % seq_len:
            raise ValueError(f"layer {idx}: {N} recorded tokens are not whole sequences of {seq_len}")
        if rope is not None:
            # [H, n*L, D] -> [H, n, L, D] -> [n, H, L, D]: one row per sequence, positions 0..L-1 each
            per_seq = keys.view(H, N // seq_len, seq_len, D).transpose(0, 1)
            positions = torch.arange(seq_len).expand(per_seq.shape[0], -1)  # [n, L]
            keys = rope.redo(per_seq, positions, idx)  # [n, H, L, D]
            keys = keys.transpose(0, 1)  # [H, n, L, D]
        k_max.append(keys.abs().reshape(H, -1).amax(dim=1))  # [H, n*L*D] -> [H]
        v_max.append(values.abs().reshape(H, -1).amax(dim=1))
    return {"k_absmax": torch.stack(k_max).float(), "v_absmax": torch.stack(v_max).float()}  # [L, H] each


def calibrate(model, input_ids: torch.Tensor, options: QuantCacheConfig, settings: dict, seed: int = 0,
              progress: bool = True, budget: float | None = None, context: int | None = None,
              sensitivity_ids: torch.Tensor | None = None, choose_rotation: bool = False,
              try_levels: bool = True, rotation_ids: torch.Tensor | None = None,
              needles: dict | None = None) -> CalibrationData:
    """Run `model` over `input_ids` [N, L] and fit, for every full-attention layer (and sliding layers when
    `options.sliding_layers == "quantized"`): key/value codebooks for the layer's k_bits/v_bits and static key ranges;
    and for every layer the K (after RoPE) / V ranges (`kv_absmax`).

    With `budget` (bits/value at `context` tokens): per-layer widths first (`calibration.budget`: sensitivities
    measured on `sensitivity_ids` [N, L], greedy allocation), stored as the file's `layer_bits`, the sensitivities in
    its settings.

    With `needles` ({"tokenizer", "text", "threshold", "length", "count"}; needs `budget`): needle floors first
    (`calibration.budget.needle_floors`: each (layer, stream) at the narrowest width whose needle answers lose at most
    `threshold` nats on a haystack of `text`), which the allocation starts from; floors and losses go into the
    settings.

    With `choose_rotation`: whether keys are rotated too (`rotate="v"` or `"kv"`, rotated keys also on Lloyd-Max
    levels with `try_levels`) is chosen first, by the KL each gives on `rotation_ids` [N, L] (default:
    `sensitivity_ids`; `calibration.cli` gives sequences of the model's full context, where the choice can differ
    from a short one's) (`calibration.budget.choose_rotate`), and stored with the options; the KLs go into the
    settings (`rotate_kl`, measured on `rotate_tokens` tokens)."""
    torch.manual_seed(seed)
    text_config = model.config.get_text_config(decoder=True)
    fingerprint = model_fingerprint(text_config)
    layer_types = fingerprint["layer_types"] or ["full_attention"] * fingerprint["num_hidden_layers"]
    wanted = {i for i, t in enumerate(layer_types)
              if t == "full_attention" or (t == "sliding_attention" and options.sliding_layers == "quantized")}
    if rotation_ids is None:
        rotation_ids = sensitivity_ids
    if needles is not None and budget is None:
        raise ValueError("needle floors shape a per-layer plan: give a budget (bits/value) with them")
    if budget is not None and sensitivity_ids is None:
        raise ValueError("a budget needs the sequences to measure on (sensitivity_ids)")
    if choose_rotation and rotation_ids is None:
        raise ValueError("a rotation choice needs the sequences to measure on (rotation_ids or sensitivity_ids)")
    reference = reference_logprobs(model, sensitivity_ids) if budget is not None else None
    if choose_rotation:
        options, kls = choose_rotate(model, rotation_ids, options, try_levels=try_levels,
                                     reference=reference if rotation_ids is sensitivity_ids else None)
        settings = {**settings, "rotate_kl": kls, "rotate_tokens": int(rotation_ids.numel())}
        log.info("rotate=%r, levels=%r chosen (KL on the calibration text: %s)", options.rotate, options.levels, kls)
    if budget is not None:
        if context is None:
            raise ValueError("a budget needs the context it is counted at")
        quantized = sorted(wanted)
        floors = None
        if needles is not None:
            floors, losses = needle_floors(model, needles["tokenizer"], needles["text"], options, quantized,
                                           needles["threshold"], length=needles["length"], count=needles["count"],
                                           seed=seed, progress=progress)
            settings = {**settings, "needle_threshold": needles["threshold"], "needle_length": needles["length"],
                        "needle_count": needles["count"],
                        "needle_floors": {f"{layer}.{stream}": w for (layer, stream), w in floors.items()},
                        "needle_losses": {f"{layer}.{stream}.{w}": round(v, 4)
                                          for (layer, stream, w), v in losses.items()}}
            log.info("needle floors above %d bits: %s", min(floors.values()),
                     {k: w for k, w in floors.items() if w > min(floors.values())})
        sens, base_kl = measure_sensitivities(model, sensitivity_ids, options, quantized, progress=progress,
                                              reference=reference)
        heads, head_dim = fingerprint["num_key_value_heads"], fingerprint["head_dim"]
        plan = allocate(sens, options, budget, len(layer_types), quantized, heads, head_dim, context, floors=floors)
        options = dataclasses.replace(options, layer_bits=plan)
        settings = {**settings, "budget_bits_per_value": budget, "budget_context": context,
                    "plan_bits_per_value": round(plan_bits_per_value(options, plan, quantized, heads, head_dim,
                                                                     context), 4),
                    "sensitivity_tokens": int(sensitivity_ids.numel()), "sensitivity_base_kl": base_kl,
                    "layer_sensitivities": {f"{layer}.{stream}.{w}": round(v, 6)
                                            for (layer, stream, w), v in sens.items()}}
        log.info("per-layer widths for %s bits/value at %d tokens: %s", budget, context, plan)
    stats = collect_statistics(model, input_ids, progress=progress)
    head_dim = fingerprint["head_dim"]
    v_group = options.value_group_size(head_dim)
    layers = {}
    for idx in tqdm(sorted(wanted), desc="fit layers", disable=not progress):
        s = stats[idx]
        own = options.for_layer(idx)
        zero, rng = fit_static_key_range(s["keys"], own.k_bits, seed=seed)
        static_scale = rng / (2**own.k_bits - 1)
        k_u, k_w = key_samples(s["keys"], s["k_weight"], options.k_group_size,
                               static=(zero, rng) if options.static_keys else None, outliers=options.outliers)
        v_u, v_w = value_samples(s["values"], s["v_weight"], v_group, outliers=options.outliers)
        layers[idx] = {
            "k_codebook": fit_codebook(k_u, k_w, own.k_bits, seed=seed),
            "v_codebook": fit_codebook(v_u, v_w, own.v_bits, seed=seed),
            "k_channel_weight": s["k_weight"].float(),
            "k_static_zero": zero.float(),
            "k_static_scale": static_scale.float(),
        }
    kv_ranges = kv_absmax(stats, text_config, int(input_ids.shape[1]))
    settings = {**settings, "method": METHOD, "seed": seed, "k_bits": options.k_bits, "v_bits": options.v_bits,
                "clip_candidates": list(CLIP_CANDIDATES), "tokens": int(input_ids.numel())}
    return CalibrationData(fingerprint, options.to_dict(), settings, layers, kv_ranges=kv_ranges)
