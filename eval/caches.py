"""One factory for every cache we compare: ours, the default, and the quantized caches Transformers ships.

    kind        what it builds
    ----------  ---------------------------------------------------------------------------------------------
    default     transformers.DynamicCache(config=...)
    quant       qcache.QuantCache (bits / k_bits / v_bits / any QuantCacheConfig option / calibration file)
    hf-quanto   transformers.QuantizedCache(backend="quanto", nbits in {2, 4}; axis 0 for K and V, its defaults)
    hf-hqq      transformers.QuantizedCache(backend="hqq", nbits in {2, 3, 4, 8}; axis 1 for K and V)
    hf-fp8      transformers.QuantizedCache(backend="fp8") (8 bits, per-tensor scale)

Transformers' own caches keep the last `residual_length` (128) tokens in full precision and re-quantize their
whole cache at every flush; they reject models with sliding-window layers (raised here, not worked around).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["CACHE_KINDS", "HF_BITS", "build_cache", "cache_factory", "cache_label"]

CACHE_KINDS = ("default", "quant", "hf-quanto", "hf-hqq", "hf-fp8")
HF_BITS = {"hf-quanto": (2, 4), "hf-hqq": (2, 3, 4, 8), "hf-fp8": (8,)}
_HF_BACKENDS = {"hf-quanto": ("quanto", {"axis_key": 0, "axis_value": 0}),
                "hf-hqq": ("hqq", {"axis_key": 1, "axis_value": 1}),
                "hf-fp8": ("fp8", {})}
_INSTALL_HINT = {"hf-quanto": "pip install optimum-quanto", "hf-hqq": "pip install hqq"}


def build_cache(kind: str, model_config, bits: int | None = None, **options):
    """A fresh cache of `kind` for a model with `model_config` (see the module docstring)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache={kind!r} is not supported; allowed values: {list(CACHE_KINDS)}")
    if kind == "default":
        if bits is not None or options:
            raise ValueError(f"cache='default' takes no quantization options (got bits={bits}, {options})")
        from transformers import DynamicCache

        return DynamicCache(config=model_config)
    if kind == "quant":
        from qcache.cache import QuantCache

        calibration = options.pop("calibration", None)
        if calibration is not None:
            return QuantCache.from_calibration(calibration, config=model_config, bits=bits, **options)
        return QuantCache(model_config, bits=bits, **options)
    backend, axes = _HF_BACKENDS[kind]
    if options:
        raise ValueError(f"cache={kind!r} takes only bits; got options {sorted(options)}")
    if kind == "hf-fp8":
        if bits not in (None, 8):
            raise ValueError(f"cache='hf-fp8' stores 8 bits; got bits={bits}")
    elif bits not in HF_BITS[kind]:
        raise ValueError(f"cache={kind!r} supports bits in {list(HF_BITS[kind])}; got bits={bits}")
    if kind in _INSTALL_HINT:
        import importlib.util

        module = "optimum.quanto" if kind == "hf-quanto" else "hqq"
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise ImportError(f"cache={kind!r} needs {module}: {_INSTALL_HINT[kind]} (or pip install 'qcache[peers]')")
    from transformers import QuantizedCache

    kwargs = {} if kind == "hf-fp8" else {"nbits": bits, **axes}
    return QuantizedCache(backend=backend, config=model_config, **kwargs)


def cache_factory(kind: str, model_config, bits: int | None = None, **options) -> Callable[[], object]:
    """A zero-argument callable building fresh caches (validated once, now)."""
    build_cache(kind, model_config, bits, **dict(options))
    return lambda: build_cache(kind, model_config, bits, **dict(options))


def cache_label(kind: str, bits: int | None = None, **options) -> str:
    """A short row label such as 'quant-4bit', 'quant-k4v2' (keys and values at their own widths) or
    'hf-quanto-2bit'; 'quant-layers(layer_bits=...)' for widths given layer by layer.

    Example:
        >>> cache_label("quant", k_bits=4, v_bits="2", rotation="hadamard")
        'quant-k4v2(rotation=hadamard)'
    """
    if kind == "default":
        return "default"
    if kind == "quant" and bits is None and "preset" in options:  # a named setting (qcache/presets.py)
        options = dict(options)
        label = f"quant-{options.pop('preset')}"
    elif kind == "quant" and bits is None and "bits_per_value" in options:  # per-layer widths within a budget
        options = dict(options)
        label = f"quant-{options.pop('bits_per_value')}bpv"
    elif kind == "quant" and bits is None and options.get("layer_bits") is not None:  # widths given layer by layer
        label = "quant-layers"
    elif kind == "quant" and bits is None:
        from qcache.config import QuantCacheConfig

        options = dict(options)
        k_bits = int(options.pop("k_bits", None) or QuantCacheConfig.k_bits)
        v_bits = int(options.pop("v_bits", None) or QuantCacheConfig.v_bits)
        label = f"quant-{k_bits}bit" if k_bits == v_bits else f"quant-k{k_bits}v{v_bits}"
    else:
        label = f"{kind}-{bits if bits is not None else 8 if kind == 'hf-fp8' else ''}bit"
    extra = ",".join(f"{k}={v}" for k, v in sorted(options.items()) if v is not None)
    return f"{label}({extra})" if extra else label
