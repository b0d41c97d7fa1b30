"""QuantCacheConfig: the recipe of a quantized cache, one frozen row of concrete options.

Every field holds a value (nothing is resolved from the others): the dataclass defaults are the row of
`QuantCache(bits=4)`, and `qcache.presets.PRESETS` holds the other rows (`QuantCache(bits=3)` is a lookup there).
Changing one option is `dataclasses.replace(recipe, name=value)`; a combination that does not hold raises in the
check of the part it belongs to (widths, keys, values, rotation, kept tokens, sliding layers), naming every option that
conflicts and what is allowed. A calibration file stores its recipe (`to_dict`); `qcache.calibfile.legacy_recipe` reads
the options of files written before the recipe was complete. The bytes a recipe holds are `qcache.layout.bytes_per_token`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .layout import CLIP_RATIOS  # tried per group with clip_search=True
from .quant import SUPPORTED_BITS  # the rows of qcache.quant.WIDTHS
SCALE_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}  # name -> bytes per element
SLIDING_MODES = ("native", "quantized", "tokens")
ROPE_MODES = ("pre", "post")
KERNELS = ("auto", "eager", "compiled", "native")
ROTATIONS = ("none", "hadamard")  # qcache/rotation.py
LEVELS = ("uniform", "lloyd-max")  # qcache/levels.py
ROTATE = ("auto", "kv", "k", "v")  # which of keys and values a rotation applies to ("auto": qcache/keyrot.py)
V_SCALES = ("minmax", "norm")  # qcache/codec.py ValueCodec
WINDOW_BITS = (16, 8)  # the residual window: as given, or 8-bit per token
WINDOW_KEYS = ("rotated", "minmax")  # the 8-bit window's keys: Hadamard-rotated, or as given, before their token range
# options added after recipes were written out complete (calibration format 3, saved caches), with what a recipe
# written before them meant by leaving them out
ADDED_OPTIONS = {"window_keys": "minmax"}

__all__ = ["QuantCacheConfig", "format_layer_bits", "parse_layer_bits", "SUPPORTED_BITS", "CLIP_RATIOS", "SCALE_DTYPES",
           "SLIDING_MODES", "ROPE_MODES", "KERNELS", "ROTATIONS", "LEVELS", "ROTATE", "V_SCALES", "WINDOW_BITS"]


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {list(allowed)}")


def _check_nonneg_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _conflicts(reason: str, cfg, required: dict, why: dict, fix: str | None = None) -> None:
    """Raise one error naming every option of `cfg` that differs from `required` (what `reason` needs)."""
    bad = [name for name, value in required.items() if getattr(cfg, name) != value]
    if not bad:
        return
    said = "; ".join(f"{n}={getattr(cfg, n)!r} {why[n]}" if n in why else f"got {n}={getattr(cfg, n)!r}" for n in bad)
    allowed = ", ".join(f"{n}={required[n]!r}" for n in bad)
    raise ValueError(f"{reason}: {said}; allowed with it: {allowed}" + (f", or {fix}" if fix else ""))


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


@dataclass(frozen=True)
class QuantCacheConfig:
    """The recipe of a `QuantCache`: one frozen row of options (docs/options.md explains each).

    Widths:
        k_bits / v_bits: bits per stored key / value (2, 3, 4 or 8).
        layer_bits: one (k_bits, v_bits) pair per layer instead (a string is read by `parse_layer_bits`).
    Keys (pre-RoPE with rope="pre", per channel):
        k_group_size: tokens per key block (one scale/zero per channel per block).
        levels: "uniform" or "lloyd-max" (data-free non-uniform levels; keys, and min-max values).
        static_keys: a calibration file's static per-channel key ranges (no key blocks).
        rope: "pre" (keys stored before RoPE) or "post" (as attention produced them).
    Values (per token):
        v_scale: "norm" (one least-squares scale per token and head, Gaussian levels; needs rotated values) or
            "minmax" (a scale and zero per group of `v_group_size` channels; None: the largest multiple of 8 up to 64
            dividing head_dim).
    Rotation:
        rotation: "hadamard" or "none"; rotation_seed: its signs; rotate: the streams rotated ("kv", "k", "v", or
            "auto": values, and keys in the layers whose weights predict a smaller score error rotated).
    Kept tokens:
        sink_tokens: first tokens in the cache dtype; recent_tokens: newest tokens kept out of the key blocks;
        window_bits: the residual (recent tokens and the block being filled) as given (16) or 8-bit per token.
        window_keys: the 8-bit residual's keys "rotated" (a Hadamard rotation spreads outlier channels over the head
            before each token's range is taken; whatever `rotation` says of the quantized region) or "minmax"
            (one range per token across the channels as attention gave them).
    Sliding-window layers:
        sliding_layers: "native" (full precision), "quantized" (key blocks) or "tokens" (each token on its own);
        sliding_bits / sliding_v_bits: their widths (None: the layer's own).
    Other:
        codebooks: use a calibration file's levels on the streams they were fitted for (`codebook_streams`);
        outliers: values per group kept aside in the cache dtype; clip_search: search a clipping ratio per group;
        scale_dtype: dtype of scales and zeros; kernel: "auto", "eager", "compiled" or "native" (qcache/kernels.py,
            qcache/native.py).

    Example:
        >>> QuantCacheConfig().k_bits
        4
        >>> dataclasses.replace(QuantCacheConfig(), recent_tokens=256).recent_tokens
        256
    """

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
    codebooks: bool = True
    static_keys: bool = False
    kernel: str = "auto"
    outliers: int = 0
    rotation: str = "hadamard"
    rotation_seed: int = 0
    levels: str = "uniform"
    rotate: str = "auto"
    v_scale: str = "norm"
    window_bits: int = 8
    window_keys: str = "rotated"
    layer_bits: tuple[tuple[int, int], ...] | None = None
    sliding_bits: int | None = None
    sliding_v_bits: int | None = None

    def __post_init__(self) -> None:
        for check in (_check_widths, _check_keys, _check_rotation, _check_values, _check_kept, _check_sliding,
                      _check_other):  # one per part of the recipe (below the class)
            check(self)

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
        return dataclasses.replace(self, k_bits=self.sliding_bits, v_bits=v_bits, sliding_bits=None,
                                   sliding_v_bits=None)

    def uses_rotation(self) -> bool:
        """Whether a layer with these options needs the Hadamard rotation: for the quantized region (`rotation`) or
        for the 8-bit window's keys (`window_keys="rotated"`)."""
        return self.rotation != "none" or (self.window_bits == 8 and self.window_keys == "rotated")

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
        """Every option, by name (the complete recipe a calibration file stores)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QuantCacheConfig":
        """The recipe `to_dict` wrote: every option named, none unknown (an option added since recipes were complete
        and missing from an older one takes the behaviour from before it, `ADDED_OPTIONS`)."""
        names = [f.name for f in dataclasses.fields(cls)]
        d = {**{n: v for n, v in ADDED_OPTIONS.items() if n not in d}, **d}
        unknown, missing = sorted(set(d) - set(names)), [n for n in names if n not in d]
        if unknown or missing:
            raise ValueError(f"a recipe names every QuantCacheConfig option once; got unknown {unknown}, missing "
                             f"{missing}; allowed: {names}")
        return cls(**d)


# -- the checks, one per part of the recipe (`QuantCacheConfig.__post_init__`) ---------------------------------
def _check_widths(cfg: "QuantCacheConfig") -> None:
    _check_choice("k_bits", cfg.k_bits, SUPPORTED_BITS)
    _check_choice("v_bits", cfg.v_bits, SUPPORTED_BITS)
    if cfg.layer_bits is None:
        return
    pairs = parse_layer_bits(cfg.layer_bits) if isinstance(cfg.layer_bits, str) else cfg.layer_bits
    if (not isinstance(pairs, (list, tuple)) or not pairs
            or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs)):
        raise ValueError(f"layer_bits={pairs!r} must be a non-empty list of (k_bits, v_bits) pairs, one per layer")
    for i, (kb, vb) in enumerate(pairs):
        _check_choice(f"layer_bits[{i}] k_bits", kb, SUPPORTED_BITS)
        _check_choice(f"layer_bits[{i}] v_bits", vb, SUPPORTED_BITS)
    object.__setattr__(cfg, "layer_bits", tuple((int(kb), int(vb)) for kb, vb in pairs))

def _check_rotation(cfg: "QuantCacheConfig") -> None:
    _check_choice("rotation", cfg.rotation, ROTATIONS)
    _check_nonneg_int("rotation_seed", cfg.rotation_seed)
    _check_choice("rotate", cfg.rotate, ROTATE)
    if cfg.rotation == "none":
        _conflicts("rotation='none' rotates nothing", cfg, {"rotate": "kv", "v_scale": "minmax"},
                   {"rotate": "needs a rotation", "v_scale": "needs rotated values (its levels assume them)"})

def _check_keys(cfg: "QuantCacheConfig") -> None:
    _check_positive_int("k_group_size", cfg.k_group_size)
    _check_choice("levels", cfg.levels, LEVELS)
    _check_choice("rope", cfg.rope, ROPE_MODES)
    _check_choice("static_keys", cfg.static_keys, (True, False))
    if cfg.static_keys:  # calibrated in unrotated space, on each channel's fixed range
        _conflicts("static_keys=True holds calibrated, unrotated key ranges", cfg,
                   {"rotation": "none", "rotate": "kv", "v_scale": "minmax", "levels": "uniform", "outliers": 0},
                   {"rotation": "is not supported with static_keys=True (static key ranges are calibrated in "
                                "unrotated space)",
                    "levels": "is not supported with static_keys=True (the levels are fitted to each group's own "
                              "min/max, static keys have none)",
                    "rotate": "needs a rotation", "v_scale": "needs rotated values",
                    "outliers": "is not supported with static_keys=True"})

def _check_values(cfg: "QuantCacheConfig") -> None:
    _check_choice("v_scale", cfg.v_scale, V_SCALES)
    if cfg.v_group_size is not None:
        _check_positive_int("v_group_size", cfg.v_group_size)
        if cfg.v_group_size % 8:
            raise ValueError(f"v_group_size={cfg.v_group_size} must be a multiple of 8 (bit packing works on 8 "
                             "values)")
    if cfg.v_scale == "norm":
        if cfg.rotation == "hadamard" and cfg.rotate == "k":
            raise ValueError(f"v_scale='norm' needs rotated values (its levels assume them); got rotation="
                             f"{cfg.rotation!r}, rotate={cfg.rotate!r}; allowed: rotate 'auto', 'kv' or 'v', or "
                             "v_scale='minmax'")
        _conflicts("v_scale='norm' scales whole heads (no groups, outliers or range clipping)", cfg,
                   {"outliers": 0, "clip_search": False, "v_group_size": None}, {}, fix="v_scale='minmax'")

def _check_kept(cfg: "QuantCacheConfig") -> None:
    _check_nonneg_int("sink_tokens", cfg.sink_tokens)
    _check_nonneg_int("recent_tokens", cfg.recent_tokens)
    _check_choice("window_bits", cfg.window_bits, WINDOW_BITS)
    _check_choice("window_keys", cfg.window_keys, WINDOW_KEYS)

def _check_sliding(cfg: "QuantCacheConfig") -> None:
    _check_choice("sliding_layers", cfg.sliding_layers, SLIDING_MODES)
    if cfg.sliding_bits is not None:
        _check_choice("sliding_bits", cfg.sliding_bits, SUPPORTED_BITS)
        if cfg.sliding_layers == "native":
            raise ValueError(f"sliding_bits={cfg.sliding_bits} sets the width of quantized sliding-window layers, "
                             f"but sliding_layers={cfg.sliding_layers!r} keeps them as they are; allowed: "
                             "sliding_layers='quantized' or 'tokens' with it, or sliding_bits=None")
        if cfg.layer_bits is not None:
            raise ValueError(f"sliding_bits={cfg.sliding_bits} and layer_bits both set the widths of sliding "
                             "layers; allowed: one of them (layer_bits holds a pair for every layer)")
    if cfg.sliding_v_bits is not None:
        _check_choice("sliding_v_bits", cfg.sliding_v_bits, SUPPORTED_BITS)
        if cfg.sliding_bits is None:
            raise ValueError(f"sliding_v_bits={cfg.sliding_v_bits} sets the value width of sliding layers beside "
                             "their key width, sliding_bits, which is None; allowed: sliding_bits=N with it, or "
                             "sliding_v_bits=None")

def _check_other(cfg: "QuantCacheConfig") -> None:
    _check_choice("scale_dtype", cfg.scale_dtype, tuple(SCALE_DTYPES))
    _check_choice("kernel", cfg.kernel, KERNELS)
    for name in ("clip_search", "codebooks"):
        _check_choice(name, getattr(cfg, name), (True, False))
    _check_nonneg_int("outliers", cfg.outliers)
    if cfg.outliers:
        if max(cfg.k_group_size, cfg.v_group_size or 0) > 256:
            raise ValueError(f"outliers need groups of at most 256 (1-byte offsets); got k_group_size="
                             f"{cfg.k_group_size}, v_group_size={cfg.v_group_size}")
        smallest = min(cfg.k_group_size, cfg.v_group_size or 8)
        if cfg.outliers >= smallest:
            raise ValueError(f"outliers={cfg.outliers} must be smaller than every group (k_group_size="
                             f"{cfg.k_group_size}, v_group_size={cfg.v_group_size or 'auto, >= 8'})")
