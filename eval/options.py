"""Cache options as lm-eval and the runners hand them over, and how a sequence is fed through a cache in chunks.

No lm-eval import here: the fidelity runner, the needles and the doctor use these without lm-eval's start-up cost.

Example:
    >>> parse_cache_options({"bits": "3", "sink_tokens": "0"})
    (3, {'sink_tokens': 0})
"""

from __future__ import annotations

from qcache.config import format_layer_bits, parse_layer_bits
from qcache.tools.spec import RECIPE_OPTIONS, to_bool, to_int, typed_option
from qcache.tools.data import chunk_bounds  # the pieces every cache is fed in (the needles use it too)

__all__ = ["CACHE_OPTIONS", "MODEL_DTYPES", "check_positive_int", "chunk_bounds", "model_dtype", "format_layer_bits", "parse_cache_options", "parse_layer_bits", "to_bool",
           "to_int"]

# QuantCacheConfig fields a user may set, the width (`bits`: the preset row of that width) or row (`preset`), plus
# the calibration file and what chooses a per-layer plan (`layer_bits` is written as `parse_layer_bits` reads it;
# `calibration=auto,bits_per_value=B` chooses one for a budget)
CACHE_OPTIONS = RECIPE_OPTIONS + ("calibration", "bits_per_value", "needle_floor", "needle_length")


# model weights' dtypes the runners accept, by name (torch dtypes looked up when used: this module stays import-light)
MODEL_DTYPES = ("bfloat16", "float16", "float32")


def model_dtype(name: str):
    """The torch dtype named `name` (one of MODEL_DTYPES)."""
    import torch

    if name not in MODEL_DTYPES:
        raise ValueError(f"dtype={name!r} is not supported; allowed values: {sorted(MODEL_DTYPES)}")
    return getattr(torch, name)


def check_positive_int(name: str, value) -> None:
    """Raise unless `value` is an int >= 1 (bools refused)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def parse_cache_options(options: dict) -> tuple[int | None, dict]:
    """Split `--model_args` cache options into (bits, other options), with ints and bools parsed.

    Example:
        >>> parse_cache_options({"bits": "4", "recent_tokens": "0", "rope": "post", "static_keys": "false"})
        (4, {'recent_tokens': 0, 'rope': 'post', 'static_keys': False})
    """
    unknown = sorted(set(options) - set(CACHE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown cache options {unknown}; allowed: {sorted(CACHE_OPTIONS)}")
    parsed = {}
    for name, value in options.items():
        if name in RECIPE_OPTIONS:
            value = typed_option(name, value)
        elif name == "needle_length":
            value = to_int(name, value)
        elif name in ("bits_per_value", "needle_floor") and value is not None:
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{name}={value!r} must be a number") from None
        if value is not None:
            parsed[name] = str(value) if name == "calibration" else value
    widths = sorted({"bits", "k_bits", "v_bits"} & set(parsed))
    if "layer_bits" in parsed and widths:
        raise ValueError(f"layer_bits and {', '.join(widths)} both set widths; allowed: one of them")
    return parsed.pop("bits", None), parsed
