"""What one cache layer holds, from the parts its codecs declare.

`QuantLayer` builds its codecs here (`key_codec`, `value_codec`, `token_codecs`) and its store from `layer_parts`;
the bytes a layer holds at a context are those parts times how many entries each axis has then (`entries`). So
`bytes_per_token` (what `python -m qcache.size` and the per-layer budget read) and the store that
`cache.memory()` measures count the same declared tensors: there is no second formula to keep in step.

    axis       entries at the end of N tokens (a full-attention layer; S sinks, R recent tokens, G tokens per block)
    sink       min(S, N)
    token      q = (N - sinks - R) rounded down to whole blocks (0 if negative)
    block      q / G (no block parts with static key ranges)
    residual   N - sinks - q: the block being filled and the recent window (full precision, or 8-bit tokens)
    early      with 8-bit residual tokens, N - sinks while q = 0 (held as given; the residual is empty then)

A window-only sliding layer (`QuantCacheConfig.holds_window_only`) keeps every token of its window in the residual,
each quantized on its own by `token_codecs`.
"""

from __future__ import annotations

import dataclasses

import torch

from .codec import KeyCodec, ValueCodec
from .store import Part

__all__ = ["key_codec", "value_codec", "token_codecs", "window_codecs", "window_parts", "layer_parts", "entries",
           "held_bytes", "bytes_per_token", "full_precision_tokens", "token_bytes", "CLIP_RATIOS"]

CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # tried per group with clip_search=True
_FP_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.float32}  # a stand-in dtype of the cache's element size


def _scale_dtype(cfg) -> torch.dtype:
    return getattr(torch, cfg.scale_dtype)


def _clip(cfg) -> tuple[float, ...]:
    return CLIP_RATIOS if cfg.clip_search else (1.0,)


def key_codec(cfg, codebook: bool = False) -> KeyCodec:
    """The key codec of a layer with options `cfg` (`codebook`: its levels come from a codebook)."""
    return KeyCodec(bits=cfg.k_bits, group=1 if cfg.static_keys else cfg.k_group_size, scale_dtype=_scale_dtype(cfg),
                    outliers=cfg.outliers, clip_ratios=_clip(cfg), codebook=codebook, static=cfg.static_keys,
                    rotation=cfg.rotation != "none" and "k" in cfg.rotate)


def value_codec(cfg, head_dim: int, calibrated_levels: bool = False) -> ValueCodec:
    """The value codec of a layer with options `cfg` for `head_dim` channels (`calibrated_levels`: a calibration
    file's codebook applies to values)."""
    return ValueCodec(bits=cfg.v_bits, group=cfg.value_group_size(head_dim), scale_dtype=_scale_dtype(cfg),
                      outliers=cfg.outliers, clip_ratios=_clip(cfg),
                      codebook=calibrated_levels or cfg.levels == "lloyd-max" or cfg.v_scale == "norm",
                      # rotate="auto" rotates values (keys are chosen per layer before its first update)
                      rotation=cfg.rotation != "none" and cfg.rotate in ("auto", "kv", "v"), norm=cfg.v_scale == "norm")


def token_codecs(cfg, head_dim: int, widths: tuple[int, int], v_head_dim: int | None = None
                 ) -> tuple[ValueCodec, ValueCodec]:
    """Codecs of residual key and value tokens at `widths` (k, v) bits, per token and head, in the form
    `cfg.token_form` names for each width (the 8-bit window, or a window-only layer's tokens); keys of `head_dim`
    channels, values of `v_head_dim` (default: the same)."""
    codecs = []
    for prefix, bits, head_dim in zip(("wk_", "wv_"), widths, (head_dim, v_head_dim or head_dim)):
        form = cfg.token_form(bits)
        if form == "norm":
            codecs.append(ValueCodec(bits=bits, group=head_dim, scale_dtype=_scale_dtype(cfg), codebook=True,
                                     rotation=True, norm=True, prefix=prefix, axis="residual"))
        else:
            group = head_dim if form == "minmax8" else cfg.token_group_size(head_dim)
            codecs.append(ValueCodec(bits=bits, group=group, scale_dtype=_scale_dtype(cfg), prefix=prefix,
                                     axis="residual"))
    return codecs[0], codecs[1]


def window_codecs(cfg, head_dim: int, window_only: bool, v_head_dim: int | None = None
                  ) -> tuple[ValueCodec, ValueCodec] | None:
    """The residual's token codecs (None: the residual is kept as attention gave it)."""
    if window_only:
        return token_codecs(cfg, head_dim, (cfg.k_bits, cfg.v_bits), v_head_dim)
    if cfg.window_bits == 8:
        keys, values = token_codecs(cfg, head_dim, (8, 8), v_head_dim)
        return dataclasses.replace(keys, rotation=cfg.window_keys == "rotated"), values
    return None


def window_parts(window: tuple[ValueCodec, ValueCodec], head_dim: int, dtype: torch.dtype,
                 v_head_dim: int | None = None) -> list[Part]:
    """The parts of the residual's key and value token codecs (keys of `head_dim` channels, values of `v_head_dim`,
    default the same)."""
    return [part for codec, width in zip(window, (head_dim, v_head_dim or head_dim))
            for part in codec.parts(width, dtype)]


def layer_parts(k: KeyCodec, v: ValueCodec, window: tuple[ValueCodec, ValueCodec] | None, head_dim: int,
                dtype: torch.dtype, v_head_dim: int | None = None) -> list[Part]:
    """Every tensor a layer stores: the key and value codecs' parts, the sinks and the residual (keys of `head_dim`
    channels, values of `v_head_dim`, default the same)."""
    widths = {"k": head_dim, "v": v_head_dim or head_dim}
    parts = k.parts(widths["k"], dtype) + v.parts(widths["v"], dtype)
    parts += [Part(f"sink_{s}", "sink", (widths[s],), dtype, "full_precision") for s in "kv"]
    if window is not None:  # the 8-bit residual, and the tokens held as given until the layer first quantizes
        parts += window_parts(window, head_dim, dtype, v_head_dim)
        parts += [Part(f"early_{s}", "early", (widths[s],), dtype, "full_precision") for s in "kv"]
    else:
        parts += [Part(f"res_{s}", "residual", (widths[s],), dtype, "full_precision") for s in "kv"]
    return parts


def entries(cfg, num_tokens: int, window_only: bool = False) -> dict[str, int]:
    """Entries per store axis after `num_tokens` tokens (the module docstring's table; worst case of the block
    being filled). A window-only layer: `num_tokens` is its window and all of it is residual."""
    if window_only:
        return {"sink": 0, "token": 0, "block": 0, "residual": num_tokens, "early": 0}
    sinks = min(cfg.sink_tokens, num_tokens)
    block = 1 if cfg.static_keys else cfg.k_group_size
    q = max(num_tokens - sinks - cfg.recent_tokens, 0) // block * block
    # an 8-bit residual holds its tokens as given ("early") until the layer first quantizes a block
    early = num_tokens - sinks if q == 0 and cfg.window_bits == 8 else 0
    return {"sink": sinks, "token": q, "block": q // cfg.k_group_size, "residual": num_tokens - sinks - q - early,
            "early": early}


def held_bytes(cfg, head_dim: int, num_tokens: int, fp_bytes: int = 2, window_only: bool = False) -> int:
    """Bytes one head of a layer with options `cfg` holds after `num_tokens` tokens in a cache whose elements take
    `fp_bytes` bytes: its declared parts times their entries."""
    dtype = _FP_DTYPES[fp_bytes]
    window = window_codecs(cfg, head_dim, window_only)
    if window_only:  # no key blocks and no sinks: only the window's tokens
        parts = window_parts(window, head_dim, dtype)
    else:
        parts = layer_parts(key_codec(cfg), value_codec(cfg, head_dim), window, head_dim, dtype)
    counts = entries(cfg, num_tokens, window_only)
    return sum(part.entry_bytes * counts[part.axis] for part in parts)


def full_precision_tokens(cfg, num_tokens: int) -> int:
    """Tokens of a `num_tokens`-long sequence that a block layer with options `cfg` keeps unquantized: the sinks and
    the residual (worst case of the per-channel block being filled)."""
    counts = entries(cfg, num_tokens)
    return counts["sink"] + counts["residual"] + counts["early"]


def token_bytes(cfg, head_dim: int) -> float:
    """Bytes per token and head of a window-only sliding layer's key and value together."""
    return held_bytes(cfg, head_dim, 1, window_only=True)


def bytes_per_token(cfg, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
                    fp_bytes: int = 2) -> float:
    """Expected bytes held per token (one batch row), averaged over `num_tokens`, all layers of options `cfg`: the
    parts a layer's codecs declare (packed data, scales/zeros, outliers, sinks and the residual) times their entries
    at `num_tokens`, plus the int64 first position kept per row. Matches what `QuantCache.memory()` counts, less its
    preallocated-but-unused capacity (`reserved`), the RoPE helper's few KB (`rope`) and the per-cache constants
    (`codebooks`, `rotation`). With `layer_bits`: the mean over its layers, times `num_layers`."""
    cfg.check_head_dim(head_dim)
    if cfg.layer_bits is not None:
        per_layer = [bytes_per_token(cfg.for_layer(i), 1, num_kv_heads, head_dim, num_tokens, fp_bytes)
                     for i in range(len(cfg.layer_bits))]
        return num_layers * sum(per_layer) / len(per_layer)
    per_head = held_bytes(cfg, head_dim, num_tokens, fp_bytes)  # the parts the layer's codecs declare
    positions = 8  # int64 position of the row's first token (per batch row, per layer)
    return num_layers * (num_kv_heads * per_head + positions) / num_tokens
