"""The calibration file: safetensors, tensors named by layer, string metadata (DESIGN §3).

    tensor                      shape         meaning
    --------------------------  ------------  ----------------------------------------------------------------
    layers.{i}.k_codebook       [2**k_bits]   sorted key levels in [0, 1] of each group's range (non-uniform)
    layers.{i}.v_codebook       [2**v_bits]   the same for values
    layers.{i}.k_channel_weight [H, D]        key sensitivity per channel (query energy), what k-means weighed
    layers.{i}.k_static_zero    [H, D]        optional static pre-RoPE key range per channel (clipped)
    layers.{i}.k_static_scale   [H, D]

Metadata (all strings): format_version, qcache_version, model (JSON fingerprint: model_type, layers, kv heads,
head_dim, layer types, RoPE parameters), options (JSON QuantCacheConfig), settings (JSON: bits, method, data
source and sha256, tokens, seed, ...), layers (JSON list of calibrated layer indices).
Files are written to a temporary file in the same directory, fsynced, then renamed over the target.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

__all__ = ["FORMAT_VERSION", "CalibrationData", "save_calibration", "load_calibration", "REQUIRED_TENSORS"]

FORMAT_VERSION = "1"
REQUIRED_TENSORS = ("k_codebook", "v_codebook")
OPTIONAL_TENSORS = ("k_channel_weight", "k_static_zero", "k_static_scale")
_REQUIRED_META = ("format_version", "qcache_version", "model", "options", "settings", "layers")


class CalibrationData:
    """What a calibration file holds: per-layer tensors plus the metadata that says what they are for."""

    def __init__(self, model: dict, options: dict, settings: dict, layers: dict[int, dict[str, torch.Tensor]],
                 qcache_version: str | None = None, path: str | None = None):
        self.model = model
        self.options = options
        self.settings = settings
        self.layers = layers
        self.qcache_version = qcache_version
        self.path = path

    def layer(self, idx: int) -> dict[str, torch.Tensor] | None:
        return self.layers.get(idx)

    def check_model(self, fingerprint: dict) -> None:
        """Raise if this file was made for another model."""
        if fingerprint != self.model:
            diff = {k: (self.model.get(k), fingerprint.get(k)) for k in set(fingerprint) | set(self.model)
                    if fingerprint.get(k) != self.model.get(k)}
            raise ValueError(f"calibration file {self.path or ''} was made for another model (file, model): {diff}")


def save_calibration(path: str | os.PathLike, data: CalibrationData) -> Path:
    """Write atomically: an interrupted run leaves no file at `path` (only a temporary file that never loads)."""
    from safetensors.torch import save_file

    from . import __version__

    path = Path(path)
    tensors = {}
    for idx, layer in sorted(data.layers.items()):
        missing = [name for name in REQUIRED_TENSORS if name not in layer]
        if missing:
            raise ValueError(f"layer {idx} lacks required tensors {missing}")
        for name, tensor in layer.items():
            tensors[f"layers.{idx}.{name}"] = tensor.detach().cpu().contiguous()
    metadata = {
        "format_version": FORMAT_VERSION,
        "qcache_version": __version__,
        "model": json.dumps(data.model, sort_keys=True),
        "options": json.dumps(data.options, sort_keys=True),
        "settings": json.dumps(data.settings, sort_keys=True),
        "layers": json.dumps(sorted(data.layers)),
    }
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
    return path


def load_calibration(path: str | os.PathLike) -> CalibrationData:
    """Read and validate a calibration file; a corrupt, truncated or incomplete file raises ValueError."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibration file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types for bad headers / truncated data
        raise ValueError(f"calibration file {str(path)!r} is corrupt or truncated: {err}") from err
    missing_meta = [k for k in _REQUIRED_META if k not in metadata]
    if missing_meta:
        raise ValueError(f"calibration file {str(path)!r} lacks metadata {missing_meta}; is it a qcache file?")
    if metadata["format_version"] != FORMAT_VERSION:
        raise ValueError(f"calibration file {str(path)!r} has format_version={metadata['format_version']!r}; "
                         f"this qcache reads {FORMAT_VERSION!r}")
    try:
        model, options, settings, layer_ids = (json.loads(metadata[k]) for k in ("model", "options", "settings",
                                                                                   "layers"))
    except json.JSONDecodeError as err:
        raise ValueError(f"calibration file {str(path)!r} has unreadable metadata: {err}") from err
    layers: dict[int, dict[str, torch.Tensor]] = {int(i): {} for i in layer_ids}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layers" or int(parts[1]) not in layers:
            raise ValueError(f"calibration file {str(path)!r} has an unexpected tensor {name!r}")
        if parts[2] not in REQUIRED_TENSORS + OPTIONAL_TENSORS:
            raise ValueError(f"calibration file {str(path)!r} has an unknown tensor {name!r}; known: "
                             f"{list(REQUIRED_TENSORS + OPTIONAL_TENSORS)}")
        layers[int(parts[1])][parts[2]] = tensor
    for idx, layer in layers.items():
        missing = [f"layers.{idx}.{n}" for n in REQUIRED_TENSORS if n not in layer]
        if missing:
            raise ValueError(f"calibration file {str(path)!r} is missing tensors {missing}")
        if ("k_static_zero" in layer) != ("k_static_scale" in layer):
            raise ValueError(f"calibration file {str(path)!r}: layer {idx} has only one of k_static_zero/scale")
    return CalibrationData(model, options, settings, layers, metadata["qcache_version"], str(path))
