"""The one way a cache is written on a command line: `KIND[:BITS][:NAME=VALUE,...]`.

    quant:4                         QuantCache(bits=4): the preset row "k4v4"
    quant:3:recent_tokens=64        that row with one option replaced
    quant::preset=k3v2              a row by name
    quant::k_bits=4,v_bits=2        the widths (the row of that pair, else "k4v4" with them)
    default                         the model's own cache (eval and bench also know hf-quanto, hf-hqq, hf-fp8)

The evaluation (`eval.compare`, `eval.fidelity`, lm-eval's `--model_args` as NAME=VALUE pairs), the benchmarks
(`bench/bench_speed.py`, `bench/gpu_check.py`, which add `@ATTENTION` after a spec for how the model attends) and
`python -m qcache.calibrate --cache` all read a spec here, and type each value by the `QuantCacheConfig` field it
names (`typed_option`).

Example:
    >>> parse_spec("quant:3:recent_tokens=64,kernel=eager")
    ('quant', 3, {'recent_tokens': '64', 'kernel': 'eager'})
    >>> typed_option("recent_tokens", "64"), typed_option("clip_search", "true")
    (64, True)
"""

from __future__ import annotations

import dataclasses

from qcache.config import QuantCacheConfig, parse_layer_bits

__all__ = ["parse_spec", "typed_option", "typed_options", "to_bool", "to_int", "RECIPE_OPTIONS"]

# what a spec may set about the recipe: the row (`bits`, `preset`) and every field of it
RECIPE_OPTIONS = ("bits", "preset") + tuple(f.name for f in dataclasses.fields(QuantCacheConfig))
_FIELD_TYPES = {"bits": "int", "preset": "str", **{f.name: str(f.type) for f in dataclasses.fields(QuantCacheConfig)}}
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def to_int(name: str, value) -> int | None:
    """An int option as a command line or lm-eval hands it over: int, digit string, or None/"none"."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"{name}={value!r} must be an integer")


def to_bool(name: str, value) -> bool | None:
    """A bool option as a command line or lm-eval hands it over: bool, 0/1, or true/false/yes/no in any case."""
    if value is None or isinstance(value, bool):
        return value
    key = str(value).strip().lower()
    if key in ("", "none"):
        return None
    if key not in _BOOLS:
        raise ValueError(f"{name}={value!r} must be a boolean (true/false)")
    return _BOOLS[key]


def typed_option(name: str, value):
    """`value` (a string, or already typed) as the recipe field `name` holds it; None, or "none" for a field that
    may hold None, is None."""
    if name not in _FIELD_TYPES:
        raise ValueError(f"unknown cache option {name!r}; allowed: {sorted(RECIPE_OPTIONS)}")
    kind = _FIELD_TYPES[name]
    if name == "layer_bits":
        return None if value is None or str(value).lower() == "none" else parse_layer_bits(value)
    if kind.startswith("int"):
        return to_int(name, value)
    if kind.startswith("bool"):
        return to_bool(name, value)
    if isinstance(value, str) and value.lower() == "none" and "None" in kind:
        return None  # a field that may hold None ("none" is also a value of rotation: kept as the string there)
    return value


def typed_options(options: dict) -> dict:
    """Every entry typed by `typed_option`; entries that type to None are left out (the row's value stays)."""
    typed = {name: typed_option(name, value) for name, value in options.items()}
    return {name: value for name, value in typed.items() if value is not None}


def parse_spec(text: str, kinds=None) -> tuple[str, int | None, dict]:
    """`KIND[:BITS][:NAME=VALUE,...]` -> (kind, bits or None, {name: raw string}); `kinds` the allowed kinds."""
    kind, _, rest = text.partition(":")
    bits, _, opts = rest.partition(":")
    if kinds is not None and kind not in kinds:
        raise ValueError(f"cache {text!r}: kind {kind!r} is not supported; allowed: {list(kinds)}")
    if bits and not bits.isdigit():
        raise ValueError(f"cache {text!r}: bits {bits!r} must be an integer")
    options = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"cache {text!r}: option {item!r} must be NAME=VALUE")
        if key in options:
            raise ValueError(f"cache {text!r}: option {key!r} given twice")
        options[key] = value
    return kind, int(bits) if bits else None, options
