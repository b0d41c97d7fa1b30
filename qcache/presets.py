"""The preset table: every named setting as one complete, frozen `QuantCacheConfig` row.

    QuantCache(bits=3)                          # the row "k3v3"
    QuantCache(preset="k3v2", recent_tokens=64) # a row, one option replaced

`recipe()` is the one lookup that `QuantCache`, the eval and bench cache specs and `python -m qcache.calibrate` use:
the row named by `preset`, or by `bits` ("k<bits>v<bits>"), or by the widths given (`k_bits=3, v_bits=2` is the row
"k3v2"; a pair with no row takes the default row "k4v4" with those widths); then every other option given replaces
that field of the row. Nothing is derived from anything else. Which measurements chose each row: docs/defaults.md.
"""

from __future__ import annotations

import dataclasses

from .config import QuantCacheConfig

__all__ = ["PRESETS", "DEFAULT_PRESET", "recipe", "preset_for_widths"]

_BASE = QuantCacheConfig()  # the dataclass defaults are the row of QuantCache(bits=4)

PRESETS: dict[str, QuantCacheConfig] = {
    "k8v8": dataclasses.replace(_BASE, k_bits=8, v_bits=8, window_bits=16),
    "k4v4": _BASE,
    "k4v3": dataclasses.replace(_BASE, v_bits=3),
    "k3v3": dataclasses.replace(_BASE, k_bits=3, v_bits=3),
    "k3v2": dataclasses.replace(_BASE, k_bits=3, v_bits=2, recent_tokens=256),
    "k2v2": dataclasses.replace(_BASE, k_bits=2, v_bits=2, levels="lloyd-max", codebooks=False),
}
DEFAULT_PRESET = "k4v4"


def preset_for_widths(k_bits: int, v_bits: int) -> str:
    """The name of the row for these widths: "k<K>v<V>" when the table has it, else the default row."""
    name = f"k{k_bits}v{v_bits}"
    return name if name in PRESETS else DEFAULT_PRESET


def recipe(bits: int | None = None, *, preset: str | None = None, **options) -> QuantCacheConfig:
    """The preset row chosen by `preset`, `bits` or the widths in `options`, with `options` replacing its fields.

    Example:
        >>> recipe(bits=2).levels
        'lloyd-max'
        >>> recipe(preset="k3v3", recent_tokens=64).recent_tokens
        64
    """
    options = {k: v for k, v in options.items() if v is not None}
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset={preset!r} is not a preset; allowed values: {list(PRESETS)}")
        if bits is not None:
            raise ValueError(f"preset={preset!r} and bits={bits} both choose a row; allowed: one of them (k_bits= "
                             "and v_bits= replace the preset's widths)")
        row = PRESETS[preset]
    elif bits is not None:
        if f"k{bits}v{bits}" not in PRESETS:
            allowed = sorted({int(name[1]) for name in PRESETS if name[1] == name[3]})
            raise ValueError(f"bits={bits!r} is not supported; allowed values: {allowed}")
        if {"k_bits", "v_bits", "layer_bits"} & set(options):
            raise ValueError(f"bits={bits} and {sorted({'k_bits', 'v_bits', 'layer_bits'} & set(options))} both set "
                             "widths; allowed: one of them")
        row = PRESETS[f"k{bits}v{bits}"]
    elif "k_bits" in options or "v_bits" in options:
        row = PRESETS[preset_for_widths(options.get("k_bits", _BASE.k_bits), options.get("v_bits", _BASE.v_bits))]
    else:
        row = PRESETS[DEFAULT_PRESET]
    names = {f.name for f in dataclasses.fields(QuantCacheConfig)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"unknown QuantCache options {unknown}; allowed: {sorted(names)}")
    return dataclasses.replace(row, **options) if options else row
