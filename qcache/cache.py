"""QuantCache: a transformers `Cache` that stores keys pre-RoPE per channel and values per token, bit-packed.

The cache binds to a model (its config given, or found from the attention module that first calls `update`: see
qcache/binding.py), builds one layer per model layer (qcache/layers.py: quantized key blocks, a sliding window of
quantized tokens, or a native sliding window) from its recipe (`QuantCacheConfig`, `qcache.presets`) and a
calibration file's tensors, and hands every `update` to its layer.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from transformers.cache_utils import Cache

from .binding import attention_module_on_stack, check_states, module_kv_heads
from ._compat import binding_context, check_transformers
from .calibfile import CalibrationData, differences, load_calibration, model_fingerprint
from .config import QuantCacheConfig
from .keyrot import layer_ratio
from .layers import (BlockLayer, CacheMemory, QuantLayer, SlidingWindowLayer, TokenWindowLayer,
                     check_calibration_options, layer_memory, make_layer, _nbytes)
from .persist import fork_cache, load_cache, save_cache
from .presets import recipe
from .rotation import SharedRotation
from .rope import RopeHelper, modeling_module_of

__all__ = ["QuantCache", "QuantLayer", "BlockLayer", "TokenWindowLayer", "SlidingWindowLayer", "CacheMemory",
           "model_fingerprint"]

logger = logging.getLogger(__name__)

_CALIBRATION_TENSORS = ("k_codebook", "v_codebook", "k_static_zero", "k_static_scale")  # what a cache uses


def _recipe_and_calibration(options, calibration, preset, kwargs) -> tuple[QuantCacheConfig, CalibrationData | None]:
    """What `QuantCache(...)` was asked for: the recipe (`options=`, a preset row with keyword options replacing its
    fields, or a calibration file's recipe with them), and the calibration file's tensors a cache reads."""
    if options is not None and (kwargs or preset is not None):
        raise ValueError(f"pass either options= or keyword options/preset, not both (got "
                         f"{sorted(kwargs) + (['preset'] if preset else [])})")
    if preset is not None and calibration is not None:
        raise ValueError(f"preset={preset!r} chooses a recipe and a calibration file holds its own; allowed with "
                         "calibration=: keyword options, not preset=")
    if isinstance(calibration, (str, bytes)) or hasattr(calibration, "__fspath__"):
        calibration = load_calibration(calibration)
    if calibration is not None:  # keep only what a cache reads (not e.g. the channel weights k-means used)
        calibration = CalibrationData(
            calibration.model, calibration.options, calibration.settings,
            {i: {n: t for n, t in layer.items() if n in _CALIBRATION_TENSORS}
             for i, layer in calibration.layers.items()},
            calibration.qcache_version, calibration.path)
    if options is None:
        given = {k: v for k, v in kwargs.items() if v is not None}
        if calibration is not None:  # the file's recipe, the options given replacing its fields
            bits = given.pop("bits", None)
            if bits is not None:
                given = {"k_bits": bits, "v_bits": bits, **given}
            options = dataclasses.replace(calibration.recipe, **given)
        else:
            options = recipe(preset=preset, **given)
    return options, calibration


class QuantCache(Cache):
    """A quantized KV cache for `model.generate` and plain forward passes.

    Keys are stored pre-RoPE, quantized per channel over blocks of `k_group_size` tokens; values per token in groups
    of `v_group_size` channels; both bit-packed. Attention reads what the cache holds (dequantized); a forward pass
    into an empty cache (the prefill) attends to the states it computed, as with the default cache.

    Args:
        config: the model's config. Optional: when omitted, the cache takes it from the attention module that
            first calls `update` (so `QuantCache(bits=4)` works as written in `generate`).
        preset: a named setting of `qcache.presets.PRESETS` ("k4v4", "k4v3", "k3v3", "k3v2", "k2v2"); keyword
            options given beside it override its values.
        bits / k_bits / v_bits / ...: any `QuantCacheConfig` field, or `options=QuantCacheConfig(...)`.

    Example:
        >>> cache = QuantCache(bits=4)                                              # doctest: +SKIP
        >>> model.generate(**inputs, past_key_values=cache, max_new_tokens=20)      # doctest: +SKIP
        >>> cache.memory().total                                                    # doctest: +SKIP
    """

    def __init__(self, config=None, *, options: QuantCacheConfig | None = None,
                 calibration: "str | CalibrationData | None" = None, preset: str | None = None, **kwargs):
        check_transformers()  # an older release would hand the model's own DynamicCache the tokens, silently
        options, calibration = _recipe_and_calibration(options, calibration, preset, kwargs)
        self.calibration: CalibrationData | None = calibration
        check_calibration_options(options, calibration is not None)
        if options.static_keys and calibration is None:
            raise ValueError("static_keys=True needs a calibration file (calibration=path); allowed without one: "
                             "static_keys=False")
        self.options = options
        super().__init__(layers=[])
        self._fingerprint: dict | None = None
        self._module_heads: dict[int, int | None] = {}  # kv heads per layer read from its attention module (_bind)
        self._rotation: SharedRotation | None = None  # rotation="hadamard": one matrix for all layers (at _bind)
        self._config_obj = None
        self._text_config = None
        self._warned_key_rotation = False  # rotate="auto" unable to decide (no weights to read): warned once
        self._explicit = config is not None
        if config is not None:
            self._bind(config.get_text_config(decoder=True), modeling_module=None, prefix=None, config_obj=config)

    # -- binding to a model ----------------------------------------------------------------------------------
    @classmethod
    def from_calibration(cls, path, config=None, **overrides) -> "QuantCache":
        """A cache using everything a `python -m qcache.calibrate` file holds (options, codebooks, static key
        ranges); `overrides` change options (e.g. `static_keys=False`)."""
        return cls(config, calibration=path, **overrides)

    def _bind(self, text_config, modeling_module, prefix, config_obj=None) -> None:
        fingerprint = model_fingerprint(text_config)
        if self.calibration is not None:
            self.calibration.check_model(fingerprint)
        rope = None
        if self.options.rope == "pre":
            rope = RopeHelper(text_config, modeling_module=modeling_module, prefix=prefix)
        layer_types = fingerprint["layer_types"] or ["full_attention"] * fingerprint["num_hidden_layers"]
        self.options.check_layers(len(layer_types))
        # one rotation matrix for every layer (raises here if head_dim is not a multiple of 8)
        if self.options.rotation == "none" and self.options.uses_rotation() and fingerprint["head_dim"] % 8:
            raise ValueError(f"window_keys='rotated' rotates the 8-bit window's keys with a Hadamard matrix, which needs "
                             f"head_dim to be a multiple of 8; this model has head_dim={fingerprint['head_dim']} "
                             "(allowed here: window_keys='minmax' or window_bits=16)")
        self._rotation = (SharedRotation(fingerprint["head_dim"], self.options.rotation_seed)
                          if self.options.uses_rotation() else None)
        layers = []
        for idx, layer_type in enumerate(layer_types):
            calib = self.calibration.layer(idx) if self.calibration is not None else None
            if layer_type == "full_attention":
                layers.append(make_layer(self.options.for_layer(idx), idx, rope, calibration=calib,
                                         rotation=self._rotation))
            elif layer_type == "sliding_attention":
                window = text_config.sliding_window
                if self.options.sliding_layers == "native":
                    layers.append(SlidingWindowLayer(sliding_window=window))
                else:
                    layers.append(make_layer(self.options.for_sliding_layer(idx), idx, rope, sliding_window=window,
                                             calibration=calib, rotation=self._rotation))
            else:
                raise ValueError(
                    f"layer {idx} of model_type={fingerprint['model_type']!r} has layer type {layer_type!r}; "
                    "QuantCache supports: ['full_attention', 'sliding_attention']"
                )
        self.layers = layers
        self._fingerprint = fingerprint
        self._module_heads = {}
        self._config_obj = config_obj if config_obj is not None else text_config
        self._text_config = text_config

    def _check_caller(self, layer_idx: int) -> None:
        """At layer 0 of every forward: find the calling model and bind to it (first use, or a new sequence of a cache
        built without a config), or check it is the model this cache holds tokens for. Without an explicit config the
        model must be found; with one, a model that cannot be found (attention written as a free function) is
        trusted to be that config's."""
        module = attention_module_on_stack(layer_idx)
        if module is None:
            if not self._explicit:
                raise ValueError(
                    "QuantCache needs the model's config for pre-RoPE keys and could not find the calling attention "
                    "module (an nn.Module with `config` and `layer_idx` up the call stack of Cache.update; "
                    f"{binding_context()}); construct it as QuantCache(model.config, ...)"
                )
            return
        config = module.config
        if config is self._config_obj:
            return
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if self._fingerprint is None or (not self._explicit and self.get_seq_length() == 0):
            self._bind(text_config, modeling_module_of(module), type(module).__name__.replace("Attention", ""), config)
            return
        fingerprint = model_fingerprint(text_config)
        if fingerprint != self._fingerprint:
            raise ValueError(
                f"this QuantCache was built for another model (held, got): {differences(self._fingerprint, fingerprint)}"
                "; use a new QuantCache per model "
                "(or reset() it)"
            )
        self._config_obj = config

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._fingerprint is None or layer_idx == 0:
            self._check_caller(layer_idx)
        check_states(self._fingerprint, key_states, value_states, layer_idx, len(self.layers),
                     self.options.static_keys, self._layer_heads(layer_idx, key_states))
        layer = self.layers[layer_idx]
        if isinstance(layer, QuantLayer) and layer.cfg.rotate == "auto":
            self._choose_key_rotation(layer, key_states)
        return layer.update(key_states, value_states, *args, **kwargs)

    def _layer_heads(self, layer_idx: int, key_states: torch.Tensor) -> int | None:
        """The kv heads of layer `layer_idx` where they are not the config's: what the layer holds, else (at its
        first update, with another count than the config's) what its attention module computes (`module_kv_heads`)."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if isinstance(layer, QuantLayer) and layer.is_initialized:
            return layer.store.heads
        if key_states.dim() != 4 or key_states.shape[1] == self._fingerprint["num_key_value_heads"]:
            return None
        if layer_idx not in self._module_heads:  # looked up once per layer (a native sliding layer holds no store)
            self._module_heads[layer_idx] = module_kv_heads(attention_module_on_stack(layer_idx))
        return self._module_heads[layer_idx]

    def _choose_key_rotation(self, layer: BlockLayer, key_states: torch.Tensor) -> None:
        """rotate="auto": decide whether `layer` rotates its keys, from the weights of the attention module calling
        update (qcache/keyrot.py). Without weights to read the layer keeps its keys unrotated (the measured-safe
        side), said once per cache and reported by `key_rotation`."""
        idx, fp = layer.layer_idx, self._fingerprint
        try:
            ratio = layer_ratio(attention_module_on_stack(idx), self._text_config, fp["num_key_value_heads"],
                                fp["head_dim"], key_states.shape[1], layer.rope, idx, self._rotation)
        except ValueError as err:
            if not self._warned_key_rotation:
                logger.warning("%s. Keeping keys unrotated where this happens; pass rotate='v' to say so or "
                               "rotate='kv' to rotate them.", str(err).split("; allowed")[0])
                self._warned_key_rotation = True
            ratio = None
        layer.choose_key_rotation(ratio)

    @property
    def key_rotation(self) -> dict[int, dict]:
        """Per quantized layer: whether its keys are rotated (`rotated`) and, where `rotate="auto"` chose it, the
        estimated rotated/unrotated score error it chose by (`ratio`; None before that layer's first update)."""
        out = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer, QuantLayer):
                cfg = layer.cfg
                rotated = None if cfg.rotate == "auto" else ("k" in cfg.rotate and cfg.rotation != "none")
                out[i] = {"rotate": cfg.rotate, "rotated": rotated, "ratio": layer.key_rotation_ratio}
        return out

    def _refuse_linear_state(self, layer_idx: int, *args, **kwargs):
        raise ValueError(
            f"layer {layer_idx} asks the cache for a convolution/recurrent state (a Mamba or linear-attention layer "
            "of a hybrid model); QuantCache holds attention keys and values only (layer types ['full_attention', "
            "'sliding_attention'])"
        )

    # hybrid models ask for their recurrent states before any update: refuse there, not with an IndexError
    get_conv_state = update_conv_state = get_recurrent_state = update_recurrent_state = _refuse_linear_state

    def reset(self) -> None:
        super().reset()  # an empty cache may serve another model: the next sequence binds again

    # -- a prefix paid for once (qcache/persist.py) -------------------------------------------------------------
    def save(self, path) -> Path:
        """Write the cache as held (codes, scales, full-precision tokens; recipe and model fingerprint) to one
        safetensors file, atomically. `QuantCache.load` reads it back."""
        return save_cache(self, path)

    @classmethod
    def load(cls, path, model_or_config, options: QuantCacheConfig | None = None, device=None) -> "QuantCache":
        """The cache `save` wrote, for `model_or_config` (refused, naming why, for another model, another recipe
        than `options` or a damaged file); it continues exactly as the saved cache would have."""
        return load_cache(cls, path, model_or_config, options, device)

    def fork(self) -> "QuantCache":
        """An independent copy, so several continuations start from one prefix without prefilling it again."""
        return fork_cache(self)

    # -- reporting -------------------------------------------------------------------------------------------
    def memory(self) -> CacheMemory:
        """Bytes held, by kind (`CacheMemory`): `total` is every byte of every tensor reachable from the cache."""
        total = CacheMemory()
        for layer in self.layers:
            total = total + layer_memory(layer)
        rope = next((layer.rope for layer in self.layers if isinstance(layer, QuantLayer) and layer.rope), None)
        if rope is not None:
            total.rope += rope.nbytes()
        if self._rotation is not None:
            total.rotation += self._rotation.nbytes()
        if self.calibration is not None:  # the layers' tensors, counted once: only those no layer uses yet
            used = {id(t) for layer in self.layers if isinstance(layer, QuantLayer) for t in layer.const_tensors()}
            total.codebooks += _nbytes(*(t for layer in self.calibration.layers.values() for t in layer.values()
                                         if id(t) not in used))
        return total

    def __repr__(self) -> str:
        return f"QuantCache({self.options}, layers={len(self.layers)})"
