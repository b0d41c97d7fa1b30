"""QuantCacheConfig: every option of the quantized cache, validated, round-trippable to a dict.

Defaults: `QuantCacheConfig(bits=N)` for N in 2, 3, 4 is the setting the fidelity runner measured best for its size
on both test models at their full context (README "Defaults" names the runs): keys per channel in 128-token blocks,
rotated or not per layer as the model's weights say (`rotate="auto"`, qcache/keyrot.py), on uniform levels
(data-free Lloyd-Max levels at 2 bits); values Hadamard-rotated, one least-squares scale per token and head, Gaussian
Lloyd-Max levels; the residual window 8-bit. Six options default to None and follow from the others
(`QuantCacheConfig._resolve_defaults`, order `AUTO_OPTIONS`):

    rotation     "hadamard", or "none" with static_keys=True (static key ranges are unrotated)
    rotate       "auto" with a rotation: values rotated, keys rotated in the layers where the weights predict a smaller
                 score error rotated (qcache/keyrot.py: all of SmolLM2's, none of Gemma-3's global layers, where
                 rotated keys cost 5x the KL); else "kv"
    levels       "lloyd-max" when every width it applies to is 2 bits (the keys; min-max values too), unless
                 static_keys or codebooks=True ask for uniform levels, else "uniform": at 2 bits Lloyd-Max key
                 levels cut KL to 0.37x on SmolLM2 and 0.83x on Gemma-3, at 3 and 4 bits they cost 1.05-1.4x
                 (bench/ablation.py runs in docs/results); they lose the few needles 2-bit uniform keys keep
    v_scale      "norm" when values are rotated and ungrouped (no outliers, clip_search or v_group_size), else "minmax"
    codebooks    True when a calibration file's levels apply to a stream (uniform levels and unrotated keys, or
                 unrotated min-max values: `codebook_streams`), else False
    window_bits  8 when every width is at most 4 bits, else 16 (an 8-bit cache is meant to be near-lossless, and an
                 8-bit window's rounding is the size of its own)

`QuantCacheConfig.overridden` applies options on top of stored ones (a calibration file's) so that these follow.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from . import layout
from .layout import CLIP_RATIOS  # tried per group with clip_search=True
from .quant import SUPPORTED_BITS  # the rows of qcache.quant.WIDTHS
SCALE_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}  # name -> bytes per element
SLIDING_MODES = ("native", "quantized", "tokens")
ROPE_MODES = ("pre", "post")
KERNELS = ("auto", "eager", "compiled")
ROTATIONS = ("none", "hadamard")  # qcache/rotation.py
LEVELS = ("uniform", "lloyd-max")  # qcache/levels.py
ROTATE = ("auto", "kv", "k", "v")  # which of keys and values a rotation applies to ("auto": qcache/keyrot.py)
V_SCALES = ("minmax", "norm")  # qcache/codec.py ValueCodec
WINDOW_BITS = (16, 8)  # the residual window: as given, or 8-bit per token
# options whose default (None) follows from the others (QuantCacheConfig._resolve_defaults), in resolution order
AUTO_OPTIONS = ("rotation", "rotate", "v_scale", "levels", "codebooks", "window_bits")

__all__ = ["QuantCacheConfig", "format_layer_bits", "parse_layer_bits", "SUPPORTED_BITS", "CLIP_RATIOS", "SCALE_DTYPES",
           "SLIDING_MODES", "ROPE_MODES", "KERNELS", "ROTATIONS", "LEVELS", "ROTATE", "V_SCALES", "WINDOW_BITS"]


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {list(allowed)}")


def _check_nonneg_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")


_LAYER_PAIR = re.compile(r"k(\d+)v(\d+)(?:x(\d+))?")


def parse_layer_bits(value) -> tuple[tuple[int, int], ...]:
    """`layer_bits` as an option string: runs of `k<K>v<V>` (one layer) or `k<K>v<V>x<N>` (N layers in a row),
    joined by "+", in layer order; a list of pairs passes through. `QuantCacheConfig` checks the widths and the
    cache the number of layers. The form `layer_bits` takes as a string, as on a command line or in lm-eval's
    `--model_args` (where commas separate the options).

    Example:
        >>> parse_layer_bits("k3v3x2+k8v3+k4v2")
        ((3, 3), (3, 3), (8, 3), (4, 2))
    """
    if not isinstance(value, str):
        return tuple(tuple(pair) for pair in value)
    pairs = []
    for run in value.strip().split("+"):
        m = _LAYER_PAIR.fullmatch(run.strip())
        if m is None or (m.group(3) is not None and int(m.group(3)) < 1):
            raise ValueError(f"layer_bits={value!r}: {run!r} is not a run of layers; allowed: k<K>v<V> (one layer) or "
                             "k<K>v<V>x<N> (N >= 1 layers), joined by '+', e.g. k4v2x18+k8v4+k4v2x11")
        pairs += [(int(m.group(1)), int(m.group(2)))] * int(m.group(3) or 1)
    return tuple(pairs)


def format_layer_bits(pairs) -> str:
    """The option string `parse_layer_bits` reads back: consecutive equal pairs as one run.

    Example:
        >>> format_layer_bits([(3, 3), (3, 3), (8, 3)])
        'k3v3x2+k8v3'
    """
    runs = []
    for kb, vb in pairs:
        if runs and runs[-1][0] == (kb, vb):
            runs[-1][1] += 1
        else:
            runs.append([(kb, vb), 1])
    return "+".join(f"k{kb}v{vb}" + (f"x{n}" if n > 1 else "") for (kb, vb), n in runs)


@dataclass
class QuantCacheConfig:
    """Options of `QuantCache`.

    Args:
        bits: sets both `k_bits` and `v_bits` when given.
        k_bits: bits per stored key value (2, 3, 4 or 8).
        v_bits: bits per stored value value (2, 3, 4 or 8).
        k_group_size: tokens per key block (default 128); keys get one scale/zero per channel per block. The block being
            filled is kept in full precision until it is full.
        v_group_size: channels per value group; values get one scale/zero per token per group of channels.
            None: the largest multiple of 8 up to 64 that divides head_dim.
        sink_tokens: the first tokens of the cache, kept in full precision (attention sinks).
        recent_tokens: the most recent tokens kept in full precision, on top of the block being filled.
        rope: "pre" stores keys before RoPE (RoPE undone on the way in, re-applied on the way out); "post" stores
            them as attention produced them.
        sliding_layers: "native" keeps sliding-window layers (bounded by their window) in full precision;
            "quantized" quantizes them like full-attention layers (key blocks; at 8 bits for keys and values, the
            window as 8-bit tokens: see `sliding_bits`); "tokens" holds only their window, every token quantized on
            its own as it arrives: keys (after RoPE) and values per token and head, at `sliding_bits` (or the layer's
            k_bits/v_bits), no key blocks, no full-precision tokens, trimmed token by token. Below 8 bits each token
            is Hadamard-rotated and scaled by one least-squares number onto Gaussian Lloyd-Max levels (the
            `v_scale="norm"` form, for keys too) when rotation="hadamard", else min-max per group of
            `v_group_size` channels; at 8 bits min-max per token and head.
        scale_dtype: dtype of the stored scales and zero-points.
        clip_search: per group, try ranges shrunk to CLIP_RATIOS of [min, max] and keep the one with the least
            squared error (costs time when tokens are quantized, nothing when they are read).
        codebooks: with a calibration file, use its non-uniform per-layer codebooks (else uniform levels) on the
            streams they were fitted for (`codebook_streams`: unrotated keys; unrotated min-max values). Default: True
            with uniform levels where a stream takes them (the defaults: the keys), else False.
        static_keys: with a calibration file, use its static per-channel pre-RoPE key ranges: keys are quantized
            as they arrive (no full-precision block, no per-block key scales).
        outliers: dense-and-sparse quantization: per quantization group (a key channel over a block of
            `k_group_size` tokens; a value token over `v_group_size` channels), this many values farthest from the
            group's median are kept in the cache dtype with a 1-byte offset, and the group's range comes from the
            rest. 0: off. Not combinable with static_keys.
        kernel: how the cache is read each step. "compiled": unpack, dequantize, RoPE and the cast fused by
            `torch.compile` (qcache/kernels.py), a one-time compile (seconds) per cache configuration; needs what
            torch.compile needs on the device (a C++ compiler on CPU, Triton on GPU) and raises if it is missing.
            With the model on the `qcache_fp32` attention, "compiled" also decodes without handing dequantized
            keys/values to attention: one query token attends straight from the codes (`kernels.decode_attention`,
            fp32). "eager": plain PyTorch ops, the same values (up to fp32 rounding), slower. "auto" (default):
            "compiled" where torch.compile works on the cache's device (tried once per device type, with one INFO
            log line saying which path runs), else "eager"; the environment variable QCACHE_KERNEL=eager|compiled
            decides for every cache left on "auto".
        rotation: "hadamard" (default; "none" with static_keys) or "none": each quantized key (pre-RoPE) and value
            token (as `rotate` says) is multiplied by a
            seeded randomized Hadamard matrix over head_dim before it is encoded and by its transpose when read
            (qcache/rotation.py), spreading outlier channels. head_dim must be a multiple of 8 (mixing is within blocks
            of its largest power-of-two divisor: all channels for a power of two).
            Full-precision tokens are not rotated. Not combinable with static_keys (calibrated in unrotated space);
            a calibration file's codebooks apply to the streams left unrotated only.
        rotation_seed: seed of the rotation's ±1 signs (one matrix for every layer of a cache).
        rotate: what the rotation applies to: "kv" keys and values, "k" keys only, "v" values only, "auto" values and,
            layer by layer, the keys where the model's q_proj/k_proj weights predict a smaller score error rotated
            (qcache/keyrot.py; decided at a layer's first update from the attention module calling it). Default:
            "auto" with a rotation, "kv" without one (where it means nothing). Where auto cannot decide (no attention
            module up the call stack, fused or sharded projections, a norm over all heads), rotate="auto" given
            raises; left at its default, those layers keep keys unrotated (the measured-safe side) and the cache
            logs a warning naming why. `QuantCache.key_rotation` reports the choice of each layer.
        levels: "uniform" or "lloyd-max" (default: "lloyd-max" when every key width is 2, else "uniform"; see the
            module docstring): data-free non-uniform levels, the Lloyd-Max levels of
            min-max normalized Gaussian groups of the codec's group size (qcache/levels.py); best with
            rotation="hadamard". Not combinable with a calibration file's codebooks (pass codebooks=False) or
            static_keys.
        window_bits: how the residual (the recent window and the block being filled) is held (default: 8 when every
            width is at most 4 bits, else 16): 16 as
            attention gave it, in the cache dtype; 8: each key (after RoPE) and value token 8-bit, with a scale and a
            zero per token and head (`scale_dtype`): half the bytes of the window, which at 8k tokens is several
            tenths of a bit per value; its tokens are quantized again to `k_bits`/`v_bits` when their block flushes.
            Sinks stay in the cache dtype.
        layer_bits: per-layer widths: one (k_bits, v_bits) pair per layer of the model (every layer, sliding ones
            included; a layer kept native ignores its pair), instead of `k_bits`/`v_bits` for all. The number of
            pairs must equal the model's layers (checked when the cache binds to a model). A string is read as runs
            (`parse_layer_bits`): "k3v3x18+k8v3+k3v3x11" is 18 layers k3v3, one k8v3, 11 k3v3. `python -m
            qcache.calibrate --bits-per-value B` chooses them from measured sensitivities and stores them in its file.
        sliding_bits: with sliding_layers="quantized" or "tokens": the width of keys and values in sliding-window
            layers (2, 3, 4 or 8; None: the same as the other layers; not combinable with layer_bits, which sets
            every layer's widths itself). A sliding layer at 8 bits (keys and values) holds no key blocks: its whole window is
            kept as the residual's 8-bit tokens (keys after RoPE, one scale and zero per token and head, whatever
            `window_bits` says) and trimmed token by token, about half the bytes of the 16-bit window.
        sliding_v_bits: the width of values in quantized sliding-window layers when it differs from their keys
            (`sliding_bits`, which it needs): `sliding_bits=8, sliding_v_bits=4` holds 8-bit keys and 4-bit values.
        v_scale: how a value token is scaled (default: "norm" when values are rotated and no option asks for value
            groups: outliers, clip_search, v_group_size; else "minmax"). "minmax": a scale and a zero-point per group of
            `v_group_size` channels, levels spanning the group's [min, max]. "norm": one number per token and head
            (its least-squares scale, in `scale_dtype`) and the Lloyd-Max levels of a standard Gaussian, which the
            coordinates of a Hadamard-rotated token divided by its RMS approximately follow (qcache/levels.py): half
            the metadata of one "minmax" group, a quarter of four. These levels are its own: `levels` then applies to
            keys only. Needs rotation="hadamard" on values (rotate "kv" or "v"); not combinable with outliers,
            clip_search or v_group_size.

    Example:
        >>> QuantCacheConfig(bits=2).k_bits
        2
    """

    bits: int | None = None
    k_bits: int = 4
    v_bits: int = 4
    k_group_size: int = 128
    v_group_size: int | None = None
    sink_tokens: int = 4
    recent_tokens: int = 128
    rope: str = "pre"
    sliding_layers: str = "native"
    scale_dtype: str = "float16"
    clip_search: bool = False
    codebooks: bool | None = None
    static_keys: bool = False
    kernel: str = "auto"
    outliers: int = 0
    rotation: str | None = None
    rotation_seed: int = 0
    levels: str | None = None
    rotate: str | None = None
    v_scale: str | None = None
    window_bits: int | None = None
    layer_bits: tuple[tuple[int, int], ...] | None = None
    sliding_bits: int | None = None
    sliding_v_bits: int | None = None

    def __post_init__(self) -> None:
        # rotate left unset resolves to "auto", which then does not raise where it cannot decide (keys stay unrotated
        # and the cache warns); rotate="auto" given raises there. Not a field: a copy (dataclasses.replace) is strict.
        self.rotate_defaulted = self.rotate is None
        if self.bits is not None:
            _check_choice("bits", self.bits, SUPPORTED_BITS)
            self.k_bits = self.v_bits = self.bits
        if self.layer_bits is not None:
            if self.bits is not None:
                raise ValueError(f"bits={self.bits} and layer_bits both set widths; allowed: one of them")
            pairs = parse_layer_bits(self.layer_bits) if isinstance(self.layer_bits, str) else self.layer_bits
            if (not isinstance(pairs, (list, tuple)) or not pairs
                    or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs)):
                raise ValueError(f"layer_bits={pairs!r} must be a non-empty list of (k_bits, v_bits) pairs, one per "
                                 "layer")
            for i, (kb, vb) in enumerate(pairs):
                _check_choice(f"layer_bits[{i}] k_bits", kb, SUPPORTED_BITS)
                _check_choice(f"layer_bits[{i}] v_bits", vb, SUPPORTED_BITS)
            self.layer_bits = tuple((int(kb), int(vb)) for kb, vb in pairs)
        _check_choice("k_bits", self.k_bits, SUPPORTED_BITS)
        _check_choice("v_bits", self.v_bits, SUPPORTED_BITS)
        for name in ("k_group_size", "v_group_size"):
            value = getattr(self, name)
            if value is None and name == "v_group_size":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.v_group_size is not None and self.v_group_size % 8:
            raise ValueError(f"v_group_size={self.v_group_size} must be a multiple of 8 (bit packing works on 8 values)")
        _check_nonneg_int("sink_tokens", self.sink_tokens)
        _check_nonneg_int("recent_tokens", self.recent_tokens)
        _check_choice("rope", self.rope, ROPE_MODES)
        _check_choice("sliding_layers", self.sliding_layers, SLIDING_MODES)
        if self.sliding_bits is not None:
            _check_choice("sliding_bits", self.sliding_bits, SUPPORTED_BITS)
            if self.sliding_layers == "native":
                raise ValueError(f"sliding_bits={self.sliding_bits} sets the width of quantized sliding-window layers, "
                                 f"but sliding_layers={self.sliding_layers!r} keeps them as they are; allowed: "
                                 "sliding_layers='quantized' or 'tokens' with it, or sliding_bits=None")
            if self.layer_bits is not None:
                raise ValueError(f"sliding_bits={self.sliding_bits} and layer_bits both set the widths of sliding "
                                 "layers; allowed: one of them (layer_bits holds a pair for every layer)")
        if self.sliding_v_bits is not None:
            _check_choice("sliding_v_bits", self.sliding_v_bits, SUPPORTED_BITS)
            if self.sliding_bits is None:
                raise ValueError(f"sliding_v_bits={self.sliding_v_bits} sets the value width of sliding layers beside "
                                 "their key width, sliding_bits, which is None; allowed: sliding_bits=N with it, or "
                                 "sliding_v_bits=None")
        _check_choice("scale_dtype", self.scale_dtype, tuple(SCALE_DTYPES))
        _check_choice("kernel", self.kernel, KERNELS)
        _check_nonneg_int("outliers", self.outliers)
        self._resolve_defaults()
        if self.outliers:
            if self.static_keys:
                raise ValueError("outliers > 0 is not supported with static_keys=True; allowed: outliers=0")
            if max(self.k_group_size, self.v_group_size or 0) > 256:
                raise ValueError(f"outliers need groups of at most 256 (1-byte offsets); got k_group_size="
                                 f"{self.k_group_size}, v_group_size={self.v_group_size}")
            smallest = min(self.k_group_size, self.v_group_size or 8)
            if self.outliers >= smallest:
                raise ValueError(f"outliers={self.outliers} must be smaller than every group (k_group_size="
                                 f"{self.k_group_size}, v_group_size={self.v_group_size or 'auto, >= 8'})")
        for name in ("clip_search", "codebooks", "static_keys"):
            _check_choice(name, getattr(self, name), (True, False))
        _check_choice("rotation", self.rotation, ROTATIONS)
        _check_nonneg_int("rotation_seed", self.rotation_seed)
        _check_choice("levels", self.levels, LEVELS)
        _check_choice("window_bits", self.window_bits, WINDOW_BITS)
        _check_choice("rotate", self.rotate, ROTATE)
        if self.rotate != "kv" and self.rotation == "none":
            raise ValueError(f"rotate={self.rotate!r} needs a rotation; allowed with rotation='none': rotate='kv' (the "
                             "default), or set rotation='hadamard'")
        _check_choice("v_scale", self.v_scale, V_SCALES)
        if self.v_scale == "norm":
            if self.rotation == "none" or self.rotate == "k":
                raise ValueError(f"v_scale='norm' needs rotated values (its levels assume them); got rotation="
                                 f"{self.rotation!r}, rotate={self.rotate!r}; allowed: rotation='hadamard' with rotate "
                                 "'kv' or 'v', or v_scale='minmax'")
            for name, off in (("outliers", 0), ("clip_search", False), ("v_group_size", None)):
                if getattr(self, name) != off:
                    raise ValueError(f"v_scale='norm' scales whole heads (no groups, outliers or range clipping); got "
                                     f"{name}={getattr(self, name)!r}; allowed: {name}={off!r}, or v_scale='minmax'")
        if self.static_keys and self.rotation != "none":
            raise ValueError(f"rotation={self.rotation!r} is not supported with static_keys=True (static key ranges are "
                             "calibrated in unrotated space); allowed: rotation='none' or static_keys=False")
        if self.static_keys and self.levels != "uniform":
            raise ValueError(f"levels={self.levels!r} is not supported with static_keys=True (the levels are fitted to "
                             "each group's own min/max, static keys have none); allowed: levels='uniform' or "
                             "static_keys=False")

    def _resolve_defaults(self) -> None:
        """Options left at None follow from the others (module docstring: "Defaults")."""
        for name in ("static_keys", "clip_search"):
            _check_choice(name, getattr(self, name), (True, False))
        if self.rotation is None:
            self.rotation = "none" if self.static_keys else "hadamard"
        if self.rotate is None:
            self.rotate = "auto" if self.rotation != "none" else "kv"
        if self.v_scale is None:
            rotated_values = self.rotation != "none" and self.rotate in ("auto", "kv", "v")
            grouped = self.outliers or self.clip_search or self.v_group_size is not None
            self.v_scale = "norm" if rotated_values and not grouped else "minmax"
        if self.levels is None:  # Lloyd-Max where every stream `levels` applies to is 2-bit (not "norm" values)
            pairs = self.layer_bits or ((self.k_bits, self.v_bits),)
            widths = [kb for kb, _ in pairs] + ([] if self.v_scale == "norm" else [vb for _, vb in pairs])
            lloyd = max(widths) == 2 and not self.static_keys and self.codebooks is not True
            self.levels = "lloyd-max" if lloyd else "uniform"
        if self.codebooks is None:
            self.codebooks = self.levels == "uniform" and bool(self.codebook_streams())
        if self.window_bits is None:
            widths = [b for pair in (self.layer_bits or ((self.k_bits, self.v_bits),)) for b in pair]
            self.window_bits = 8 if max(widths) <= 4 else 16

    def codebook_streams(self) -> str:
        """The streams a calibration file's codebooks apply to: "k" when keys are unrotated, "v" when values are
        unrotated and min-max scaled (the codebooks were fitted to unrotated groups in their [min, max]); "kv", "k",
        "v" or "". Rotated streams keep their own levels (`v_scale="norm"`: Gaussian ones)."""
        # "auto": values rotated; keys left unrotated in some layers, which take the file's key levels
        rotated = ("v" if self.rotate == "auto" else self.rotate) if self.rotation != "none" else ""
        return ("k" if "k" not in rotated else "") + ("v" if "v" not in rotated and self.v_scale == "minmax" else "")

    def value_group_size(self, head_dim: int) -> int:
        """The value group size used for `head_dim` (raises if it does not tile head_dim)."""
        divisors = [g for g in range(8, head_dim + 1, 8) if head_dim % g == 0]
        if head_dim % 8 or not divisors:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 8 to pack codes")
        if self.v_scale == "norm":
            return head_dim
        if self.v_group_size is None:
            return max(g for g in divisors if g <= 64) if min(divisors) <= 64 else min(divisors)
        if head_dim % self.v_group_size:
            raise ValueError(
                f"v_group_size={self.v_group_size} does not divide head_dim={head_dim}; allowed values: {divisors}"
            )
        return self.v_group_size

    def for_sliding_layer(self, idx: int) -> "QuantCacheConfig":
        """The options of sliding-window layer `idx` when it is quantized: `sliding_bits` for keys and values (values
        `sliding_v_bits` if set) if set, else `for_layer(idx)`."""
        if self.sliding_bits is None:
            return self.for_layer(idx)
        v_bits = self.sliding_bits if self.sliding_v_bits is None else self.sliding_v_bits
        return dataclasses.replace(self, bits=None, k_bits=self.sliding_bits, v_bits=v_bits, sliding_bits=None,
                                   sliding_v_bits=None)

    def holds_window_only(self) -> bool:
        """Whether a quantized sliding-window layer with these options keeps no key blocks: with
        sliding_layers="tokens", or at 8 bits for keys and values, its whole window stays in the residual, each token
        quantized on its own (`token_form`; qcache/cache.py)."""
        return self.sliding_layers == "tokens" or (self.k_bits == 8 and self.v_bits == 8)

    def token_form(self, bits: int) -> str:
        """How a window-only sliding layer holds a `bits`-wide key or value token: "minmax8" (8 bits: a scale and a
        zero per token and head), "norm" (below 8 bits with a rotation: rotated, one least-squares scale, Gaussian
        levels) or "minmax" (below 8 bits unrotated: a scale and a zero per group of `v_group_size` channels)."""
        if bits == 8:
            return "minmax8"
        return "norm" if self.rotation != "none" else "minmax"

    def token_bytes(self, head_dim: int) -> float:
        """Bytes per token and head of a window-only sliding layer's key and value together (qcache/layout.py)."""
        return layout.held_bytes(self, head_dim, 1, window_only=True)

    def token_group_size(self, head_dim: int) -> int:
        """Channels per scale/zero of an unrotated window-only token below 8 bits (`v_group_size`, or the largest
        multiple of 8 up to 64 that divides head_dim)."""
        return dataclasses.replace(self, v_scale="minmax").value_group_size(head_dim)

    def for_layer(self, idx: int) -> "QuantCacheConfig":
        """The options of layer `idx`: its `layer_bits` pair as k_bits/v_bits (these options when none are set)."""
        if self.layer_bits is None:
            return self
        if not 0 <= idx < len(self.layer_bits):
            raise ValueError(f"layer {idx} has no layer_bits pair: layer_bits holds {len(self.layer_bits)} layers")
        kb, vb = self.layer_bits[idx]
        return dataclasses.replace(self, k_bits=kb, v_bits=vb, layer_bits=None)

    def check_layers(self, num_layers: int) -> None:
        """Raise if `layer_bits` does not hold one pair per layer of a model with `num_layers` layers."""
        if self.layer_bits is not None and len(self.layer_bits) != num_layers:
            raise ValueError(f"layer_bits holds {len(self.layer_bits)} (k_bits, v_bits) pairs but the model has "
                             f"{num_layers} layers; allowed: one pair per layer")

    def mean_bits(self) -> float:
        """Code bits per value, averaged over keys and values (and over layers with `layer_bits`)."""
        pairs = self.layer_bits or ((self.k_bits, self.v_bits),)
        return sum(kb + vb for kb, vb in pairs) / (2 * len(pairs))

    def check_head_dim(self, head_dim: int) -> None:
        """Raise if the value groups do not tile `head_dim`."""
        self.value_group_size(head_dim)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("bits")  # folded into k_bits / v_bits
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantCacheConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown QuantCacheConfig options {unknown}; allowed: {sorted(names)}")
        return cls(**d)

    @classmethod
    def overridden(cls, base: dict, overrides: dict) -> "QuantCacheConfig":
        """`base` (a `to_dict()`, e.g. a calibration file's options) with `overrides` applied. An option of `base`
        that equals the value its default would resolve to from the rest of `base` counts as a default: it follows
        the overrides (a file made with the defaults, then `static_keys=True`, gets `rotation="none"`); any other
        value of `base` stays as it is, and an override that conflicts with it raises."""
        base = cls.from_dict(base).to_dict()
        merged = dict(base)
        for name in AUTO_OPTIONS:
            if name not in overrides and cls.from_dict({**base, name: None}).to_dict()[name] == base[name]:
                merged[name] = None
        # options that depend on each other (levels and codebooks) each look like a default on their own; released
        # together they may resolve differently: keep base's where `base` alone would not come back
        for _ in AUTO_OPTIONS:
            again = cls.from_dict(merged).to_dict()
            changed = [n for n in AUTO_OPTIONS if merged[n] is None and again[n] != base[n]]
            if not changed:
                break
            merged[changed[0]] = base[changed[0]]
        return cls.from_dict({**merged, **overrides})

    def full_precision_tokens(self, num_tokens: int) -> int:
        """Tokens of a `num_tokens`-long sequence that this layout keeps unquantized in blocks: the sinks and the
        residual (worst case of the per-channel block being filled)."""
        counts = layout.entries(self, num_tokens)
        return counts["sink"] + counts["residual"]

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
                        fp_bytes: int = 2) -> float:
        """Expected bytes held per token (one batch row), averaged over `num_tokens`, all layers: the parts a layer's
        codecs declare (packed data, scales/zeros, outliers, sinks and the residual; qcache/layout.py) times their
        entries at `num_tokens`, plus the int64 first position kept per row. Matches what
        `QuantCache.memory()` counts, less its preallocated-but-unused capacity (`reserved`), the RoPE helper's
        few KB (`rope`) and the per-cache constants (`codebooks`, `rotation`). With `layer_bits`: the mean over its
        layers, times `num_layers`."""
        self.check_head_dim(head_dim)
        if self.layer_bits is not None:
            per_layer = [self.for_layer(i).bytes_per_token(1, num_kv_heads, head_dim, num_tokens, fp_bytes)
                         for i in range(len(self.layer_bits))]
            return num_layers * sum(per_layer) / len(per_layer)
        per_head = layout.held_bytes(self, head_dim, num_tokens, fp_bytes)  # the parts the layer's codecs declare
        positions = 8  # int64 position of the row's first token (per batch row, per layer)
        return num_layers * (num_kv_heads * per_head + positions) / num_tokens
