"""A quantized cache you can save, load and fork: a long prefix is paid for once.

`QuantCache.save(path)` writes one safetensors file holding every layer as it is held: the used entries of each
store part (codes, scales, outliers, sinks, the residual window; nothing re-quantized or dequantized), each row's
first position, the tensors a calibration file gave the layers, and a native sliding layer's keys and values. Its
metadata holds the format, the qcache version, the model fingerprint, the cache's recipe and per layer its class,
its own recipe (with `rotate="auto"` as chosen), its counters and the dtype it holds. The write is atomic.

`QuantCache.load(path, model_or_config)` rebuilds the cache for that model and refuses, naming the problem: a file
that is not one (truncated, another format), another model, a recipe other than the one asked for, a tensor
missing or of another shape, a NaN or infinite scale or value. A loaded cache continues exactly as the saved one
would have (the same stored bytes, the same reads).

`QuantCache.fork()` gives an independent copy: its own stores (cloned), sharing only what never changes (the
recipe, codecs, RoPE helper, rotation, calibration tensors), so several continuations start from one prefix.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

from .calibfile import CalibrationData, differences, model_fingerprint, write_atomically
from .config import QuantCacheConfig
from .layers import BlockLayer, QuantLayer, SlidingWindowLayer
from .store import AXES

__all__ = ["FORMAT", "save_cache", "load_cache", "fork_cache"]

FORMAT = "qcache-kv-1"


def _layer_meta(layer) -> dict:
    if isinstance(layer, QuantLayer):
        meta = {"class": type(layer).__name__, "recipe": layer.cfg.to_dict(), "initialized": layer.is_initialized,
                "key_rotation_ratio": layer.key_rotation_ratio}
        if layer.is_initialized:
            s = layer.store
            meta |= {"cumulative_length": layer.cumulative_length, "dropped": layer.dropped, "batch": s.batch,
                     "heads": s.heads, "head_dim": layer.head_dim, "dtype": str(layer.dtype).removeprefix("torch."),
                     **({"v_head_dim": layer.v_head_dim} if layer.v_head_dim != layer.head_dim else {}),
                     "lengths": {a: s.length(a) for a in AXES}}
        return meta
    initialized = bool(getattr(layer, "is_initialized", False)) and layer.keys is not None
    return {"class": type(layer).__name__, "initialized": initialized,
            "cumulative_length": getattr(layer, "cumulative_length", 0)}


def save_cache(cache, path: str | os.PathLike) -> Path:
    """Write `cache` (a bound `QuantCache`) to `path` atomically; returns the path."""
    from ._version import __version__

    if cache._fingerprint is None:
        raise ValueError("this QuantCache holds nothing yet (not bound to a model): prefill it before save()")
    tensors, layers = {}, []
    for i, layer in enumerate(cache.layers):
        meta = _layer_meta(layer)
        layers.append(meta)
        if isinstance(layer, QuantLayer):
            for name, t in layer._calibration.items():
                tensors[f"layers.{i}.calibration.{name}"] = t
            if layer.is_initialized:
                tensors |= {f"layers.{i}.store.{n}": t for n, t in layer.store.views().items() if t.numel()}
                tensors[f"layers.{i}.first"] = layer.first
        elif meta["initialized"]:
            tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"] = layer.keys, layer.values
    tensors, seen = {n: t.detach().contiguous().cpu() for n, t in tensors.items()}, set()
    for n, t in tensors.items():  # safetensors writes no shared storage: a tensor shared by layers is copied
        if t.untyped_storage().data_ptr() in seen:
            tensors[n] = t.clone()
        seen.add(tensors[n].untyped_storage().data_ptr())
    metadata = {"format": FORMAT, "qcache_version": __version__,
                "model": json.dumps(cache._fingerprint, sort_keys=True),
                "recipe": json.dumps(cache.options.to_dict(), sort_keys=True), "layers": json.dumps(layers)}
    path = Path(path)
    write_atomically(path, tensors, metadata)
    return path


def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"no saved cache at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types for truncated or foreign files
        raise ValueError(f"{path} is not a readable qcache cache file (truncated or another format): "
                         f"{type(err).__name__}: {err}") from err
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path} has format {metadata.get('format')!r}; QuantCache.load reads {FORMAT!r} "
                         "(files written by QuantCache.save)")
    try:
        meta = {k: json.loads(metadata[k]) for k in ("model", "recipe", "layers")} | {
            "qcache_version": metadata.get("qcache_version")}
    except (KeyError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: its metadata is incomplete or damaged ({err})") from err
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{path}: tensor {name!r} holds NaN or infinite values; the file is damaged")
    return meta, tensors


def load_cache(cls, path: str | os.PathLike, model_or_config, options: QuantCacheConfig | None = None,
               device: torch.device | str | None = None):
    """The cache saved at `path`, for `model_or_config` (a model: its config, and its device unless `device` is
    given), checked against `options` if given. Raises ValueError naming what does not match."""
    path = Path(path)
    meta, tensors = _read(path)
    config = getattr(model_or_config, "config", model_or_config)
    if device is None:
        device = getattr(model_or_config, "device", "cpu")
    fingerprint = model_fingerprint(config.get_text_config(decoder=True))
    if fingerprint != meta["model"]:
        raise ValueError(f"{path} holds a cache of another model (file, model): "
                         f"{differences(meta['model'], fingerprint)}")
    recipe = QuantCacheConfig.from_dict(meta["recipe"])
    if options is not None and options != recipe:
        raise ValueError(f"{path} holds a cache of another recipe (file, asked): "
                         f"{differences(recipe.to_dict(), options.to_dict())}; load it without options= or save one "
                         "with these options")
    layer_calibration = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if parts[2] == "calibration":
            layer_calibration.setdefault(int(parts[1]), {})[parts[3]] = t
    calibration = None
    if layer_calibration:  # the calibrated tensors the layers read, under the cache's recipe
        calibration = CalibrationData(meta["model"], recipe.to_dict(), {"from": str(path)}, layer_calibration,
                                      meta["qcache_version"], str(path))
    cache = cls(config, options=recipe) if calibration is None else cls(config, calibration=calibration)
    if cache.options != recipe:
        raise ValueError(f"{path}: the cache rebuilt from its recipe has options {cache.options}, not {recipe}")
    if len(meta["layers"]) != len(cache.layers):
        raise ValueError(f"{path} holds {len(meta['layers'])} layers; this model has {len(cache.layers)}")
    for i, (layer, lm) in enumerate(zip(cache.layers, meta["layers"])):
        if type(layer).__name__ != lm["class"]:
            raise ValueError(f"{path}: layer {i} was a {lm['class']}, the recipe builds a {type(layer).__name__}")
        if isinstance(layer, QuantLayer):
            _load_quant_layer(path, i, layer, lm, tensors, torch.device(device))
        elif lm["initialized"]:
            _load_native_layer(path, i, layer, lm, tensors, torch.device(device))
    return cache


def _tensor(path: Path, tensors: dict, name: str, shape: tuple | None = None) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"{path}: tensor {name!r} is missing; the file is damaged")
    t = tensors[name]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{path}: tensor {name!r} has shape {tuple(t.shape)}, the layer needs {tuple(shape)}")
    return t


def _load_quant_layer(path: Path, i: int, layer: QuantLayer, lm: dict, tensors: dict, device: torch.device) -> None:
    if isinstance(layer, BlockLayer) and layer.cfg.rotate == "auto" and lm["recipe"]["rotate"] != "auto":
        layer.choose_key_rotation(lm["key_rotation_ratio"])  # the choice it made, from the ratio it made it by
    if layer.cfg.to_dict() != lm["recipe"]:
        raise ValueError(f"{path}: layer {i} was held with other options (file, rebuilt): "
                         f"{differences(lm['recipe'], layer.cfg.to_dict())}")
    if not lm["initialized"]:
        return
    B, H, D = lm["batch"], lm["heads"], lm["head_dim"]
    dtype = getattr(torch, lm["dtype"])
    empty = torch.empty(B, H, 0, D, dtype=dtype, device=device)
    layer.lazy_initialization(empty, torch.empty(B, H, 0, lm.get("v_head_dim", D), dtype=dtype, device=device))
    s = layer.store
    for axis in AXES:
        n = lm["lengths"].get(axis, 0)
        given = {name: _tensor(path, tensors, f"layers.{i}.store.{name}", (B, H, n, *s.parts[name].shape))
                 if n else None for name in s.names(axis)}
        for name, t in given.items():
            if t is not None and t.dtype != s.parts[name].dtype:
                raise ValueError(f"{path}: tensor layers.{i}.store.{name} is {t.dtype}, the layer holds "
                                 f"{s.parts[name].dtype}")
        if n:
            s.append(axis, **{name: t.to(device) for name, t in given.items()})
    layer.first = _tensor(path, tensors, f"layers.{i}.first", (B,)).to(device)
    layer.cumulative_length, layer.dropped = lm["cumulative_length"], lm["dropped"]
    layer.key_rotation_ratio = lm["key_rotation_ratio"]


def _load_native_layer(path: Path, i: int, layer: SlidingWindowLayer, lm: dict, tensors: dict,
                       device: torch.device) -> None:
    keys, values = (_tensor(path, tensors, f"layers.{i}.{n}").to(device) for n in ("keys", "values"))
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys, values
    layer.cumulative_length = lm["cumulative_length"]


def fork_cache(cache):
    """An independent copy of `cache`: cloned stores and counters, shared immutable parts."""
    new = copy.copy(cache)
    new.layers = [layer.fork() if isinstance(layer, QuantLayer) else copy.deepcopy(layer) for layer in cache.layers]
    return new
