"""The calibration file: safetensors, tensors named by layer, string metadata, validated on load.

    tensor                      shape         meaning
    --------------------------  ------------  ----------------------------------------------------------------
    layers.{i}.k_codebook       [2**k_bits]   sorted key levels in [0, 1] of each group's range (non-uniform)
    layers.{i}.v_codebook       [2**v_bits]   the same for values
    layers.{i}.k_channel_weight [H, D]        key sensitivity per channel (query energy), what k-means weighed
    layers.{i}.k_static_zero    [H, D]        optional static pre-RoPE key range per channel (clipped)
    layers.{i}.k_static_scale   [H, D]
    k_absmax                    [L, H]        optional (format 2): largest |key| per layer and KV head, keys as
                                              attention reads them (after RoPE), over all calibration tokens
    v_absmax                    [L, H]        optional (format 2): the same for values

H = num_key_value_heads, D = head_dim, L = num_hidden_layers (every layer, calibrated or not: an engine that stores
fp8 K/V needs a range for each). Every tensor is float32 and finite.

Metadata (all strings): format_version, qcache_version, model (JSON fingerprint: model_type, layers, kv heads,
head_dim, layer types, RoPE parameters), options (JSON QuantCacheConfig), settings (JSON: bits, method, data
source and sha256, tokens, seed, ...), layers (JSON list of calibrated layer indices).
Files are written to a temporary file in the same directory, fsynced, then renamed over the target.

Format versions: "3" (options: the complete recipe, `QuantCacheConfig.to_dict`) is written; "1" (layer tensors only)
and "2" (adds the optional K/V ranges) still load, their options read by `legacy_recipe`.
`load_calibration` also takes a folder laid out like a hub repo or a hub repo id (see `qcache.hub`).

Example:
    >>> data = load_calibration("smollm2.qcache.safetensors")      # doctest: +SKIP
    >>> data.layer(0)["k_codebook"].shape, data.kv_ranges is not None  # doctest: +SKIP
    (torch.Size([16]), True)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path

import torch

__all__ = ["FORMAT_VERSION", "READABLE_VERSIONS", "CalibrationData", "save_calibration", "load_calibration",
           "REQUIRED_TENSORS", "OPTIONAL_TENSORS", "KV_RANGE_TENSORS", "TENSOR_DTYPE"]

FORMAT_VERSION = "3"
READABLE_VERSIONS = ("1", "2", "3")
LEGACY_VERSIONS = ("1", "2")  # options written before the recipe was complete
REQUIRED_TENSORS = ("k_codebook", "v_codebook")
OPTIONAL_TENSORS = ("k_channel_weight", "k_static_zero", "k_static_scale")
KV_RANGE_TENSORS = ("k_absmax", "v_absmax")  # file-level (not per layer), format 2
TENSOR_DTYPE = torch.float32
_REQUIRED_META = ("format_version", "qcache_version", "model", "options", "settings", "layers")
_FINGERPRINT_INTS = ("num_hidden_layers", "num_key_value_heads", "head_dim")


class CalibrationData:
    """What a calibration file holds: per-layer tensors plus the metadata that says what they are for.

    Args:
        model: the model fingerprint (`qcache.cache.model_fingerprint`).
        options: the recipe the file was fitted for (`QuantCacheConfig.to_dict`; `recipe` reads it).
        settings: how it was made (data, sha256, tokens, seed, method, ...).
        layers: {layer index: {tensor name: tensor}} for the calibrated layers.
        qcache_version: the qcache that wrote it.
        path: where it was read from.
        kv_ranges: optional {"k_absmax": [L, H], "v_absmax": [L, H]}: K (after RoPE) / V ranges of every layer.

    Example:
        >>> data = CalibrationData({"model_type": "llama"}, {}, {}, {})
        >>> data.layer(0) is None
        True
    """

    def __init__(self, model: dict, options: dict, settings: dict, layers: dict[int, dict[str, torch.Tensor]],
                 qcache_version: str | None = None, path: str | None = None,
                 kv_ranges: dict[str, torch.Tensor] | None = None):
        self.model = model
        self.options = options
        self.settings = settings
        self.layers = layers
        self.qcache_version = qcache_version
        self.path = path
        self.kv_ranges = kv_ranges

    @property
    def recipe(self):
        """The `QuantCacheConfig` this file was fitted for."""
        from .config import QuantCacheConfig

        return QuantCacheConfig.from_dict(self.options)

    def layer(self, idx: int) -> dict[str, torch.Tensor] | None:
        return self.layers.get(idx)

    def check_model(self, fingerprint: dict) -> None:
        """Raise if this file was made for another model."""
        if fingerprint != self.model:
            raise ValueError(f"calibration file {self.path or ''} was made for another model (file, model): "
                             f"{differences(self.model, fingerprint)}")


def differences(held: dict, given: dict) -> dict:
    """{key: (held value, given value)} for every key where two dicts (fingerprints, recipes) differ."""
    keys = [*held, *(k for k in given if k not in held)]  # in the held dict's order
    return {k: (held.get(k), given.get(k)) for k in keys if held.get(k) != given.get(k)}


def write_atomically(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file so that an interrupted run leaves no file at `path` (only a temporary file beside it
    that never loads)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_calibration(path: str | os.PathLike, data: CalibrationData) -> Path:
    """Write atomically (`write_atomically`)."""
    from ._version import __version__

    path = Path(path)
    tensors = {}
    for idx, layer in sorted(data.layers.items()):
        missing = [name for name in REQUIRED_TENSORS if name not in layer]
        if missing:
            raise ValueError(f"layer {idx} lacks required tensors {missing}")
        for name, tensor in layer.items():
            tensors[f"layers.{idx}.{name}"] = tensor.detach().cpu().contiguous()
    for name, tensor in (data.kv_ranges or {}).items():
        if name not in KV_RANGE_TENSORS:
            raise ValueError(f"kv_ranges has an unknown tensor {name!r}; known: {list(KV_RANGE_TENSORS)}")
        tensors[name] = tensor.detach().cpu().contiguous()
    metadata = {
        "format_version": FORMAT_VERSION,
        "qcache_version": __version__,
        "model": json.dumps(data.model, sort_keys=True),
        "options": json.dumps(data.options, sort_keys=True),
        "settings": json.dumps(data.settings, sort_keys=True),
        "layers": json.dumps(sorted(data.layers)),
    }
    write_atomically(path, tensors, metadata)
    return path


# ---------------------------------------------------------------------------------------------------------
# Validation (pure functions on what was read; each raises ValueError naming the file, the problem and what is
# allowed)
# ---------------------------------------------------------------------------------------------------------


def _fingerprint_problem(model) -> str | None:
    """Why `model` is not a usable fingerprint (None when it is)."""
    if not isinstance(model, dict):
        return f"is a {type(model).__name__}, not a JSON object"
    if not isinstance(model.get("model_type"), str):
        return f"model_type={model.get('model_type')!r} must be a string"
    for key in _FINGERPRINT_INTS:
        value = model.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{key}={value!r} must be a positive integer"
    types = model.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != model["num_hidden_layers"]):
        return f"layer_types must be null or a list of num_hidden_layers={model['num_hidden_layers']} names"
    return None


def _parse_layer_ids(ids, num_layers: int) -> list[int] | str:
    """The calibrated layer indices, or why they are wrong."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return f"must be a JSON list of integers, got {ids!r}"
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        return f"{bad} outside the model's layers 0..{num_layers - 1}"
    if len(set(ids)) != len(ids):
        return f"{ids} repeats a layer"
    return list(ids)


def _expected_shapes(model: dict, options) -> dict[str, tuple[int, ...]]:
    heads, head_dim, layers = model["num_key_value_heads"], model["head_dim"], model["num_hidden_layers"]
    return {
        "k_codebook": (2**options.k_bits,),
        "v_codebook": (2**options.v_bits,),
        "k_channel_weight": (heads, head_dim),
        "k_static_zero": (heads, head_dim),
        "k_static_scale": (heads, head_dim),
        "k_absmax": (layers, heads),
        "v_absmax": (layers, heads),
    }


def _tensor_problem(name: str, kind: str, tensor: torch.Tensor, shape: tuple[int, ...], options) -> str | None:
    """Why tensor `name` (of kind `kind`, e.g. "k_codebook") is unusable, or None."""
    if tensor.dtype != TENSOR_DTYPE:
        return f"{name} has dtype {tensor.dtype}; allowed: {TENSOR_DTYPE}"
    if kind.endswith("_codebook") and tensor.dim() == 1 and tuple(tensor.shape) != shape:
        bits_name = "k_bits" if kind == "k_codebook" else "v_bits"
        levels = tensor.numel()
        other = f" (a codebook for {int(math.log2(levels))} bits)" if levels > 1 and levels & (levels - 1) == 0 else ""
        return (f"{name} has {levels} levels{other}, but the file's options say {bits_name}="
                f"{getattr(options, bits_name)}: allowed is a codebook of {shape[0]} levels")
    if tuple(tensor.shape) != shape:
        return f"{name} has shape {list(tensor.shape)}; allowed: {list(shape)} for this model and these options"
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        return (f"{name} has {int((~finite).sum())} NaN/inf values out of {tensor.numel()}; "
                "allowed: finite values only")
    if kind.endswith("_codebook"):
        if bool((tensor < 0).any() or (tensor > 1).any()) or bool((tensor.diff() < 0).any()):
            return f"{name} = {tensor.tolist()}; allowed: levels sorted ascending in [0, 1]"
    elif kind == "k_static_scale":
        if bool((tensor <= 0).any()):
            return f"{name} has {int((tensor <= 0).sum())} values <= 0; allowed: scales > 0"
    elif kind in ("k_channel_weight", "k_absmax", "v_absmax") and bool((tensor < 0).any()):
        return f"{name} has {int((tensor < 0).sum())} negative values; allowed: values >= 0"
    return None


def model_fingerprint(text_config) -> dict:
    """What identifies a model for the cache: geometry, layer types and RoPE."""
    try:
        head_dim = getattr(text_config, "head_dim", None)
    except RuntimeError as err:  # transformers' per-layer configs (Gemma 4) raise on a global read of head_dim
        raise ValueError(f"model_type={text_config.model_type!r} sets head_dim per layer ({err}); QuantCache needs one "
                         "head_dim for every layer") from err
    head_dim = head_dim or text_config.hidden_size // text_config.num_attention_heads
    layer_types = getattr(text_config, "layer_types", None)
    rope = getattr(text_config, "rope_parameters", None)
    v_head_dim = getattr(text_config, "v_head_dim", None)
    # values of another width than keys (MiMo-V2-Flash): named only then, so every other fingerprint is unchanged
    wider = {"v_head_dim": int(v_head_dim)} if v_head_dim and int(v_head_dim) != int(head_dim) else {}
    return {
        "model_type": text_config.model_type,
        "num_hidden_layers": int(text_config.num_hidden_layers),
        "num_key_value_heads": int(getattr(text_config, "num_key_value_heads", None)
                                   or text_config.num_attention_heads),
        "head_dim": int(head_dim),
        "layer_types": list(layer_types) if layer_types is not None else None,
        "sliding_window": getattr(text_config, "sliding_window", None),
        "rope_parameters": json.loads(json.dumps(rope, sort_keys=True, default=str)) if rope is not None else None,
        **wider,
    }


def _fingerprint_of(model) -> dict:
    """A fingerprint dict from a fingerprint dict or a transformers config."""
    if isinstance(model, dict):
        return model
    return model_fingerprint(model.get_text_config(decoder=True) if hasattr(model, "get_text_config") else model)


def load_calibration(source: str | os.PathLike, model=None, revision: str | None = None) -> CalibrationData:
    """Read and validate a calibration file.

    Args:
        source: a .safetensors file, a folder laid out like a hub repo, or a hub repo id "org/name" (read from the
            local Hugging Face cache, downloaded when allowed: `qcache.hub.resolve_calibration`).
        model: optional fingerprint dict or transformers config; the file must have been made for it.
        revision: hub revision (branch, tag or commit) for a repo id.

    Raises ValueError naming the problem and what is allowed: not a safetensors file (random bytes, truncated),
    missing metadata, an unreadable format version, a bad fingerprint or options, unknown, missing, non-float32,
    misshapen or non-finite tensors, a codebook for other bits than the options say, codebook levels outside
    [0, 1], scales <= 0, or (with `model`) a file made for another model.
    """
    from safetensors import safe_open

    from .hub import resolve_calibration

    path = resolve_calibration(source, revision=revision)
    where = f"calibration file {str(path)!r}"
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types for bad headers / truncated data
        raise ValueError(f"{where} is corrupt or truncated (not a readable safetensors file): {err}") from err
    missing_meta = [k for k in _REQUIRED_META if k not in metadata]
    if missing_meta:
        raise ValueError(f"{where} lacks metadata {missing_meta}; is it a qcache file?")
    if metadata["format_version"] not in READABLE_VERSIONS:
        raise ValueError(f"{where} has format_version={metadata['format_version']!r}; this qcache reads "
                         f"{list(READABLE_VERSIONS)}")
    try:
        fingerprint, options_dict, settings, layer_ids = (json.loads(metadata[k]) for k in ("model", "options",
                                                                                             "settings", "layers"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} has unreadable metadata: {err}") from err
    if (problem := _fingerprint_problem(fingerprint)) is not None:
        raise ValueError(f"{where}: metadata 'model' {problem}")
    from .config import QuantCacheConfig

    try:
        legacy = metadata["format_version"] in LEGACY_VERSIONS
        options = (legacy_recipe if legacy else QuantCacheConfig.from_dict)(options_dict)
        options_dict = options.to_dict()
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: metadata 'options' are not valid QuantCacheConfig options: {err}") from err
    if isinstance(ids := _parse_layer_ids(layer_ids, fingerprint["num_hidden_layers"]), str):
        raise ValueError(f"{where}: metadata 'layers' {ids}")

    options.check_layers(fingerprint["num_hidden_layers"])
    shapes = _expected_shapes(fingerprint, options)
    known_global = KV_RANGE_TENSORS if metadata["format_version"] != "1" else ()
    layers: dict[int, dict[str, torch.Tensor]] = {i: {} for i in ids}
    kv_ranges: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if len(parts) == 1 and name in known_global:
            kind = name
            kv_ranges[name] = tensor
        elif len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) in layers:
            kind = parts[2]
            if kind not in REQUIRED_TENSORS + OPTIONAL_TENSORS:
                raise ValueError(f"{where} has an unknown tensor {name!r}; known per layer: "
                                 f"{list(REQUIRED_TENSORS + OPTIONAL_TENSORS)}")
            layers[int(parts[1])][kind] = tensor
        else:
            raise ValueError(f"{where} has an unexpected tensor {name!r}; allowed: layers.<i>.<name> for the "
                             f"calibrated layers {ids}" + (f" and {list(known_global)}" if known_global else ""))
        # with layer_bits each layer's codebooks are sized by its own pair
        own = options.for_layer(int(parts[1])) if len(parts) == 3 else options
        expected = shapes if own is options else _expected_shapes(fingerprint, own)
        if (problem := _tensor_problem(name, kind, tensor, expected[kind], own)) is not None:
            raise ValueError(f"{where}: {problem}")
    for idx, layer in layers.items():
        missing = [f"layers.{idx}.{n}" for n in REQUIRED_TENSORS if n not in layer]
        if missing:
            raise ValueError(f"{where} is missing tensors {missing}")
        if ("k_static_zero" in layer) != ("k_static_scale" in layer):
            raise ValueError(f"{where}: layer {idx} has only one of k_static_zero/scale; allowed: both or neither")
    if kv_ranges and set(kv_ranges) != set(KV_RANGE_TENSORS):
        raise ValueError(f"{where} has only {sorted(kv_ranges)} of the K/V ranges; allowed: both "
                         f"{list(KV_RANGE_TENSORS)} or neither")
    data = CalibrationData(fingerprint, options_dict, settings, layers, metadata["qcache_version"], str(path),
                           kv_ranges or None)
    if model is not None:
        data.check_model(_fingerprint_of(model))
    return data


# what a file written before an option existed meant by leaving it out: the behaviour before the option
LEGACY_OPTIONS = {"rotation": "none", "rotate": "kv", "v_scale": "minmax", "levels": "uniform", "window_bits": 16,
                  "codebooks": True}


def legacy_recipe(d: dict):
    """The recipe of a file written before recipes were complete (formats 1 and 2): an option it leaves out, or holds
    as None where it now holds a value, is the behaviour from before that option existed (`LEGACY_OPTIONS`); a
    `bits` entry sets both widths."""
    from .config import QuantCacheConfig

    d = dict(d)
    bits = d.pop("bits", None)
    if bits is not None:
        d["k_bits"] = d["v_bits"] = bits
    for name, value in LEGACY_OPTIONS.items():
        if d.get(name) is None:
            d[name] = value
    names = {f.name for f in dataclasses.fields(QuantCacheConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown QuantCacheConfig options {unknown}; allowed: {sorted(names)}")
    return QuantCacheConfig(**d)
