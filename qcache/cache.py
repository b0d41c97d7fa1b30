"""QuantCache: a transformers `Cache` that stores keys pre-RoPE per channel and values per token, bit-packed.

Layout of one layer (B = batch, H = kv heads, D = head_dim, G = k_group_size, tokens in cache order):

    ========== ======================================= ============================================
    region     keys                                    values
    ========== ======================================= ============================================
    sinks      first `sink_tokens` tokens, as given (post-RoPE), full precision
    quantized  pre-RoPE codes, one scale/zero per       codes, one scale/zero per token per
               channel per block of G tokens            `v_group_size` channels
               (`KeyCodec`)                             (`ValueCodec`)
    residual   the block being filled + `recent_tokens`, as given (post-RoPE): in the cache dtype, or 8-bit per
               token and head with `window_bits=8`
    ========== ======================================= ============================================

A sliding-window layer quantized like the others (`sliding_layers="quantized"`) drops whole key blocks once they fall
out of its window. At 8 bits for keys and values (`sliding_bits=8`), or with `sliding_layers="tokens"` at any width, it
has no blocks at all: every token of its window stays in the residual, quantized on its own per token and head as it
arrives (8-bit min-max; below 8 bits rotated onto Gaussian levels with one scale), and is trimmed token by token: at 8
bits about half the bytes of the 16-bit window, at 4 bits about a quarter.

Every tensor lives in one `PackedStore` (qcache/store.py), declared once by the codecs (qcache/codec.py) and the
layer: preallocated, appended in place, dropped from the front, cropped and batch-indexed as a whole. Positions are
one consecutive run per row (left padding allowed), kept as the position of each row's first token: a [B] tensor,
not one int per token. Tokens move from the residual to the quantized region G at a time, once, and are never
re-quantized; the quantized region only ever holds whole key blocks. `update()` returns what the cache holds:
dequantized keys (RoPE re-applied) and values for the quantized region, the stored full-precision tokens elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, fields

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from . import kernels, layout
from .binding import attention_module_on_stack, positions_from_kwargs, tensor_parallel_ranks
from ._compat import binding_context, check_transformers
from .attention import ATTN_IMPLEMENTATION as FUSED_ATTENTION  # the attention that can read codes itself
from .calibfile import CalibrationData, load_calibration, model_fingerprint
from .codec import ValueCodec
from .config import QuantCacheConfig
from .presets import recipe
from .kernels import Quantized
from .levels import gaussian_levels_tensor, levels_tensor
from .rotation import SharedRotation
from .rope import RopeHelper, modeling_module_of
from .store import PackedStore

__all__ = ["QuantCache", "QuantLayer", "CacheMemory", "model_fingerprint"]

logger = logging.getLogger(__name__)

_CALIBRATION_TENSORS = ("k_codebook", "v_codebook", "k_static_zero", "k_static_scale")  # what a cache uses


def _nbytes(*tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors if t is not None}.values())


@dataclass
class CacheMemory:
    """Bytes a cache holds, counted from its tensors; `total` is every byte reachable from the cache."""

    packed: int = 0  # bit-packed codes
    scales: int = 0  # scales and zero-points (and static key ranges)
    outliers: int = 0  # dense-and-sparse outliers: values and their 1-byte offsets
    full_precision: int = 0  # sinks, the block being filled, the recent window, native sliding layers
    codebooks: int = 0  # levels: calibrated, or data-free (levels="lloyd-max")
    positions: int = 0  # bookkeeping: the first position of each row (and a sliding layer's window size)
    rope: int = 0  # the rotary module's frequencies and the small RoPE offset tables
    reserved: int = 0  # preallocated capacity not in use yet
    rotation: int = 0  # the rotation matrix (rotation="hadamard"), one per cache and device
    tokens: int = 0  # tokens held by the longest layer

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "tokens")

    def __add__(self, other: "CacheMemory") -> "CacheMemory":
        return CacheMemory(**{f.name: (max if f.name == "tokens" else int.__add__)(getattr(self, f.name),
                                                                                 getattr(other, f.name))
                              for f in fields(self)})


def _consecutive_positions(given: torch.Tensor, first: torch.Tensor, seen: int) -> torch.Tensor:
    """The positions [B, T] of T new tokens in rows whose stored tokens are positions first[b], first[b] + 1, ...
    (`seen` of them so far), checked against the `given` position_ids [B, T]: from a row's first real token on the
    given positions must continue that run; before it (left padding) they must be <= 1 (transformers gives pads 0 or
    1). Anything else (right padding, packed sequences whose positions restart, a gap) raises."""
    T = given.shape[-1]
    expected = first[:, None] + seen + torch.arange(T, device=given.device)  # [B, T]
    real = expected >= 0
    ok = torch.where(real, given == expected, given <= 1)
    if not bool(ok.all()):
        row = int((~ok).any(dim=1).nonzero()[0, 0])
        raise ValueError(
            f"position_ids of row {row} are {given[row].tolist()[:16]}{'...' if T > 16 else ''} where QuantCache "
            f"expects one consecutive run per row continuing its cache ({expected[row].clamp(min=-1).tolist()[:16]}"
            f"{'...' if T > 16 else ''}, -1 = left padding): right padding, packed sequences (positions that restart) "
            "and gaps are not supported; pad on the left (tokenizer.padding_side='left') and use one cache per sequence"
        )
    return expected


class QuantLayer(CacheLayerMixin):
    """One layer of `QuantCache` (see the module docstring for the layout).

    Args:
        cfg: the cache options.
        layer_idx: index of the layer in the model.
        rope: the model's RoPE (None: keys stored as attention produced them, `rope="post"`).
        sliding_window: the window of a sliding-attention layer quantized like the others (None: full attention).
        calibration: this layer's calibrated tensors (`k_codebook`, `v_codebook`, `k_static_zero/_scale`) or None.
        rotation: with `cfg.rotation="hadamard"`, the cache's `SharedRotation` (counted by the cache); None: the layer
            builds its own at the first update (and counts it).
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, cfg: QuantCacheConfig, layer_idx: int, rope: RopeHelper | None,
                 sliding_window: int | None = None, calibration: dict[str, torch.Tensor] | None = None,
                 rotation: SharedRotation | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.rope = rope
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self._calibration = calibration or {}
        self._rotation = rotation
        self._owns_rotation = False
        self.key_rotation_ratio: float | None = None  # rotate="auto": the estimate the choice was made on
        # set by QuantCache each forward: the attention is qcache_fp32, which can attend from the codes directly
        self.fused_attention = False
        # a window-only layer has no key blocks, so nothing for rotate="auto" to decide (its tokens have codecs of
        # their own); any other layer decides before its first update (`choose_key_rotation`)
        if cfg.rotate == "auto" and self.is_sliding and cfg.holds_window_only():
            cfg = dataclasses.replace(cfg, rotate="v")
        self._configure(cfg)
        self._clear()

    def _configure(self, cfg: QuantCacheConfig) -> None:
        """Take `cfg` as this layer's recipe: its constants and key codec (the value codec needs head_dim and is
        built at the first update)."""
        self.cfg = cfg
        calibration = self._calibration
        _check_calibration_options(cfg, bool(calibration))
        streams = cfg.codebook_streams() if cfg.codebooks else ""  # the streams the file's levels were fitted for
        k_consts = {"codebook": calibration.get("k_codebook") if "k" in streams else None}
        v_consts = {"codebook": calibration.get("v_codebook") if "v" in streams else None}
        for name, cb, bits in (("k_codebook", k_consts["codebook"], cfg.k_bits),
                               ("v_codebook", v_consts["codebook"], cfg.v_bits)):
            if cb is not None and cb.numel() != 2**bits:
                raise ValueError(f"layer {self.layer_idx}: calibrated {name} has {cb.numel()} levels but {bits} bits "
                                 f"need {2**bits}; calibrate for these bits or pass codebooks=False")
        if cfg.static_keys:
            if "k_static_zero" not in calibration:
                raise ValueError(f"static_keys=True needs a calibration file with static key ranges (layer "
                                 f"{self.layer_idx} has none); allowed without one: static_keys=False")
            k_consts["static_zero"], k_consts["static_scale"] = (calibration["k_static_zero"],
                                                                 calibration["k_static_scale"])  # [H, D] each
        # the layer holds its whole window as tokens quantized one by one and evicts token by token: no key blocks,
        # so no block being filled and no whole-block slack beyond the window
        self.window_only = self.is_sliding and cfg.holds_window_only()
        if cfg.levels == "lloyd-max" and not self.window_only:  # data-free levels (value group known at first update)
            k_consts["codebook"] = levels_tensor(cfg.k_bits, cfg.k_group_size, cfg.outliers)
        self.consts = {"k": k_consts, "v": v_consts}
        self.k_codec = layout.key_codec(cfg, codebook=k_consts["codebook"] is not None)
        self.v_codec: ValueCodec | None = None  # its group depends on head_dim: built at the first update
        self.sink_tokens = 0 if self.is_sliding else cfg.sink_tokens

    def choose_key_rotation(self, ratio: float | None) -> None:
        """rotate="auto": rotate this layer's keys if `ratio` (estimated score error rotated / unrotated,
        qcache/keyrot.py) is below 1, else (or with None: no estimate) leave them unrotated (and on a calibration
        file's key levels, if any)."""
        if self.cfg.rotate != "auto":
            raise RuntimeError(f"layer {self.layer_idx} has rotate={self.cfg.rotate!r}: nothing to choose")
        if self.is_initialized:
            raise RuntimeError(f"layer {self.layer_idx} already holds tokens; its key rotation is chosen before that")
        rotate = "kv" if ratio is not None and ratio < 1 else "v"
        self._configure(dataclasses.replace(self.cfg, rotate=rotate, codebooks=self.cfg.codebooks and rotate == "v"))
        self.key_rotation_ratio = None if ratio is None else float(ratio)

    # -- state -----------------------------------------------------------------------------------------------
    def _clear(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None  # unused: kept for transformers code that peeks at them
        self.store: PackedStore | None = None
        self.first: torch.Tensor | None = None  # [B] int64: position of each row's first stored token
        self.dropped = 0  # quantized tokens evicted from the front (sliding layers)
        self.cumulative_length = 0  # tokens ever seen (what sliding masks count)
        self._pending_fused = False  # update handed attention the codes: decode_attention must consume them

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape  # key_states: [B, H, T, D]
        if self.cfg.rotate == "auto":  # no QuantCache chose it from the model's weights
            logger.warning("layer %d: a QuantLayer used on its own with rotate='auto': keys unrotated (no model "
                           "weights to decide by); pass rotate='v' to say so or rotate='kv'", self.layer_idx)
            self.choose_key_rotation(None)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.v_codec = layout.value_codec(self.cfg, D, calibrated_levels=self.consts["v"]["codebook"] is not None)
        if self.window_only:  # its tokens have codecs of their own (`layout.token_codecs`)
            pass
        elif self.cfg.v_scale == "norm":
            self.consts["v"]["codebook"] = gaussian_levels_tensor(self.cfg.v_bits)
        elif self.cfg.levels == "lloyd-max":
            self.consts["v"]["codebook"] = levels_tensor(self.cfg.v_bits, self.v_codec.group, self.cfg.outliers)
        if self.cfg.rotation != "none":
            if self._rotation is None:
                self._rotation, self._owns_rotation = SharedRotation(D, self.cfg.rotation_seed), True
            elif self._rotation.head_dim != D:
                raise ValueError(f"layer {self.layer_idx}: rotation built for head_dim {self._rotation.head_dim}, "
                                 f"states have head_dim {D}")
            for stream in self.cfg.rotate:  # "k" and/or "v"
                self.consts[stream]["rotation"] = self._rotation.on(self.device)
        self.kernel = kernels.resolve_kernel(self.cfg.kernel, self.device)  # "eager" or "compiled"
        # a window-only layer: every token of the window on its own, at this layer's widths; else the residual
        # 8-bit per token (min-max, a scale/zero per token and head) or as attention gave it
        self.window_codecs = layout.window_codecs(self.cfg, D, self.window_only)
        self.window_consts = None if self.window_codecs is None else self._token_consts(self.window_codecs)
        G = self.k_codec.group
        parts = layout.layer_parts(self.k_codec, self.v_codec, self.window_codecs, D, self.dtype)
        self.store = PackedStore(parts, B, H,
                                 self.device, min_grow={"token": max(G, 16), "block": 1,
                                                        "sink": max(self.sink_tokens, 1), "residual": G},
                                 # between two flushes the residual holds at most the recent window + one block
                                 bounded={"sink": self.sink_tokens,
                                          "residual": self.sliding_window if self.window_only
                                          else self.cfg.recent_tokens + G})
        for consts in self.consts.values():
            for name, t in consts.items():
                if t is not None and t.device != self.device:
                    consts[name] = t.to(self.device)
        self.is_initialized = True

    def _token_consts(self, codecs: tuple[ValueCodec, ValueCodec]) -> tuple[dict, dict]:
        """The constants of residual token codecs: the rotation and Gaussian levels of the "norm" form."""
        return tuple({"rotation": self._rotation.on(self.device),
                      "codebook": gaussian_levels_tensor(codec.bits).to(self.device)} if codec.norm else {}
                     for codec in codecs)

    @property
    def quantized_length(self) -> int:
        return 0 if not self.is_initialized else self.store.length("token")

    def stored_length(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(self.store.length(a) for a in ("sink", "token", "residual"))

    def _quantized(self) -> Quantized:
        """The quantized region as the kernels read it (views of the store, RoPE factors of its positions)."""
        s = self.store
        rope = None
        if self.rope is not None:
            q0 = self.first + s.length("sink") + self.dropped  # [B]: position of the first quantized token
            rope = self.rope.factors(q0, s.length("token"), self.layer_idx, self.cfg.k_group_size)
        views = s.views()
        k = {n: views[n] for n in s.parts if n.startswith(self.k_codec.prefix)}
        v = {n: views[n] for n in s.parts if n.startswith(self.v_codec.prefix)}
        return Quantized(k, v, self.consts["k"], self.consts["v"], rope)

    # -- update ----------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new states and return all keys/values as the cache now holds them ([B, H, T_total, D])."""
        if self._pending_fused:
            raise RuntimeError(
                f"layer {self.layer_idx}: the previous decode step handed attention the quantized region by reference "
                "(kernel='compiled' with qcache_fp32 attention) but attention never read it, so that step attended "
                "over the full-precision tokens only. Something between Cache.update and the attention function "
                "dropped the link (a hook or wrapper that copies key/value states?); use kernel='eager' or a stock "
                "attention implementation with it"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.store.batch or key_states.shape[-1] != self.store.parts["sink_k"].shape[0]:
            raise ValueError(
                f"layer {self.layer_idx} holds batch {self.store.batch} x head_dim {self.store.parts['sink_k'].shape[0]}"
                f" but got key_states of shape {tuple(key_states.shape)}; call reset() before reusing the cache"
            )
        B, _, T, _ = key_states.shape  # key_states: [B, H, T, D]
        position_ids = positions_from_kwargs(kwargs)
        if position_ids is None:
            if self.rope is not None:
                raise ValueError(
                    "QuantCache(rope='pre') needs the position_ids that attention passes to Cache.update (in its "
                    f"kwargs) and got none ({binding_context()}): this model's attention calls update without them, "
                    "so pre-RoPE keys cannot be placed; allowed for it: rope='post'"
                )
            position_ids = torch.arange(self.cumulative_length, self.cumulative_length + T, device=self.device)[None]
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq]; got shape {tuple(position_ids.shape)}")
        given = position_ids.to(self.device).expand(B, T)
        if self.first is None:  # each row's run ends at its last token
            self.first = (given[:, -1] - (T - 1)).long()
        _consecutive_positions(given, self.first, self.cumulative_length)
        kv_before = self.get_mask_sizes(T)[0] - T if self.is_sliding else None
        self.cumulative_length += T

        key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        s = self.store
        n_sink = 0
        if s.length("token") + s.length("residual") == 0:
            n_sink = max(min(self.sink_tokens - s.length("sink"), T), 0)
        s.append("sink", sink_k=key_states[:, :, :n_sink], sink_v=value_states[:, :, :n_sink])
        self._append_window(key_states[:, :, n_sink:], value_states[:, :, n_sink:])
        self._flush()

        if T == 1 and self.fused_attention and self._decode_fusable():
            return self._lazy_states()
        keys, values = self.read()
        if self.is_sliding:
            keys, values = keys[:, :, -(kv_before + T):], values[:, :, -(kv_before + T):]
            self._evict()
        return keys, values

    def _append_window(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append tokens (cache dtype, keys after RoPE) to the residual window, 8-bit with `window_bits=8`."""
        if self.window_codecs is None:
            self.store.append("residual", res_k=k, res_v=v)
            return
        (ck, cv), (kc, vc) = self.window_codecs, self.window_consts
        self.store.append("residual", **ck.encode(k.float(), kc), **cv.encode(v.float(), vc))

    def _window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual window's keys (after RoPE) and values [B, H, R, D] in the cache dtype."""
        s = self.store
        if self.window_codecs is None:
            return s.view("res_k"), s.view("res_v")
        views = s.views("residual")
        return tuple(torch.cat(c.planes({n: t for n, t in views.items() if n.startswith(c.prefix)}, consts),
                               dim=-1).to(self.dtype) for c, consts in zip(self.window_codecs, self.window_consts))

    def _flush(self) -> None:
        """Quantize whole blocks of G tokens out of the residual, keeping `recent_tokens` in full precision."""
        if self.window_only:
            return
        s = self.store
        G = self.k_codec.group
        n = (s.length("residual") - self.cfg.recent_tokens) // G * G
        if n <= 0:
            return
        k, v = (t[:, :, :n] for t in self._window())  # [B, H, n, D]
        # positions of these tokens: they follow the sinks and the quantized region of their row
        start = s.length("sink") + self.dropped + s.length("token")
        p = self.first[:, None] + start + torch.arange(n, device=self.device)  # [B, n]
        valid = (p >= 0)[:, None, :, None]  # [B, 1, n, 1]: padding stays out of the statistics
        k = self.rope.undo(k, p, self.layer_idx) if self.rope is not None else k.float()  # fp32, pre-RoPE
        parts = self.k_codec.encode(k, self.consts["k"], valid) | self.v_codec.encode(v.float(), self.consts["v"])
        for axis in ("token", "block"):
            s.append(axis, **{name: t for name, t in parts.items() if s.parts[name].axis == axis})
        s.drop_front("residual", n)

    def _evict(self) -> None:
        """Sliding layers: drop whole quantized blocks (tokens for static keys) that no future query can see."""
        s = self.store
        keep = self.sliding_window - 1
        G = self.k_codec.group
        drop = min(max(self.stored_length() - keep, 0), s.length("token")) // G * G
        if drop:
            s.drop_front("token", drop)
            if s.names("block"):
                s.drop_front("block", drop // G)
            self.dropped += drop
        surplus = min(self.stored_length() - keep, s.length("residual"))
        if s.length("token") == 0 and surplus > 0:  # only full-precision tokens left: trim them exactly
            s.drop_front("residual", surplus)
            self.dropped += surplus

    # -- reading ---------------------------------------------------------------------------------------------
    @property
    def _kernel_variant(self) -> tuple:
        """What makes the compiled functions' code differ between caches (each gets its own compile budget)."""
        return (self.k_codec, self.v_codec, self.rope is not None, self.dtype)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE applied) and values as the cache holds them, in the cache dtype: [sinks | dequantized |
        residual], [B, H, T_stored, D]."""
        s = self.store
        sink_k, sink_v = s.view("sink_k"), s.view("sink_v")
        res_k, res_v = self._window()
        if s.length("token") == 0:
            return torch.cat([sink_k, res_k], dim=2), torch.cat([sink_v, res_v], dim=2)
        q = self._quantized()
        if self.kernel == "compiled":
            keys = kernels.compiled("read_keys", self._kernel_variant)(sink_k, q, res_k, self.k_codec)
            values = kernels.compiled("read_values", self._kernel_variant)(sink_v, q, res_v, self.v_codec)
            return keys, values
        S, Tq, R = sink_k.shape[2], s.length("token"), res_k.shape[2]
        B, H, _, D = res_k.shape
        keys = res_k.new_empty(B, H, S + Tq + R, D)
        values = res_v.new_empty(B, H, S + Tq + R, D)
        keys[:, :, :S], keys[:, :, S + Tq:] = sink_k, res_k
        values[:, :, :S], values[:, :, S + Tq:] = sink_v, res_v
        _write_planes(keys[:, :, S:S + Tq], kernels.key_planes(q, self.k_codec))
        _write_planes(values[:, :, S:S + Tq], self.v_codec.planes(q.v, q.v_consts))
        return keys, values

    # -- fused decode attention (kernel="compiled" with the qcache_fp32 attention) --------------------------------
    def _decode_fusable(self) -> bool:
        return self.kernel == "compiled" and not self.is_sliding and self.store.length("token") > 0

    def _lazy_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What `update` returns when attention will read the codes itself: the full-precision tokens
        [sinks | residual], tagged with this layer (`_qcache_layer`). Only qcache_fp32 attention receives them; it
        attends over sinks, quantized region and residual with `decode_attention`, or calls `read()`. If the tag is
        lost on the way, the next update of this layer raises (the step attended over less than the cache holds)."""
        s = self.store
        res_k, res_v = self._window()
        keys = torch.cat([s.view("sink_k"), res_k], dim=2)
        values = torch.cat([s.view("sink_v"), res_v], dim=2)
        keys._qcache_layer = values._qcache_layer = self
        self._pending_fused = True
        return keys, values

    def consume_lazy_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full keys/values for an attention that got tagged states but does not attend from the codes."""
        self._pending_fused = False
        return self.read()

    def decode_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None,
                         fp_states: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """fp32 attention of one query token [B, Hq, 1, D] over everything held, straight from the codes
        (`kernels.decode_attention`); attention_mask: None, bool (True = attend) or additive, [B, 1, 1, T_held];
        fp_states: what `update` returned ([sinks | residual] keys and values). Returns [B, Hq, 1, D] fp32."""
        self._pending_fused = False
        s = self.store
        B, Hq, _, D = query.shape
        H = s.heads
        S, Tq, R = s.length("sink"), s.length("token"), s.length("residual")
        bias = None
        if attention_mask is not None:
            if attention_mask.shape[-1] != S + Tq + R or attention_mask.shape[1] != 1:
                raise ValueError(
                    f"layer {self.layer_idx}: attention mask of shape {tuple(attention_mask.shape)} for "
                    f"{S + Tq + R} cached tokens; fused decode attention needs [B, 1, 1, {S + Tq + R}]"
                )
            bias = attention_mask.float()
            if attention_mask.dtype == torch.bool:
                bias = torch.zeros_like(bias).masked_fill_(~attention_mask, torch.finfo(torch.float32).min)
        fp_k, fp_v = fp_states
        if fp_k.shape[2] != S + R:
            raise ValueError(f"layer {self.layer_idx}: got {fp_k.shape[2]} full-precision tokens, the layer holds "
                             f"{S + R}: pass what update() returned for this step")
        q = query.float().reshape(B, H, Hq // H, D)  # query head h*G+g reads kv head h (as repeat_kv)
        out = kernels.compiled("decode_attention", self._kernel_variant)(
            q, fp_k, fp_v, bias, self._quantized(), S, D**-0.5 if scaling is None else scaling, self.k_codec,
            self.v_codec)
        return out.reshape(B, Hq, 1, D)

    # -- transformers' layer contract ------------------------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.cumulative_length if self.is_sliding else self.stored_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.is_sliding:
            return self.get_seq_length() + query_length, 0
        past = self.cumulative_length
        kv_offset = max(past - self.sliding_window + 1, 0)
        kv_length = min(past, self.sliding_window - 1) + query_length
        return kv_length, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self._clear()

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.store.map_batch(fn)
        if self.first is not None:
            self.first = fn(self.first)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder rows of every stored tensor (codes included: nothing is re-quantized)."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a negative int, as for `DynamicLayer`).

        Whole key blocks that stay keep their codes and scales. A crop through a key block (assisted decoding's
        rollback) takes the block's kept tokens back into the residual with the values they were stored with
        (dequantized, RoPE re-applied, in the cache dtype) and forgets the block's codes and scales, so nothing of the
        removed tokens stays in any kept range; the block is quantized again once it refills."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as for DynamicLayer"
            )
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if self.is_sliding and self.cumulative_length >= self.sliding_window:
            raise ValueError("cannot crop a quantized sliding-window layer once its window is full")
        s = self.store
        n = min(n, self.stored_length())
        self.cumulative_length -= n
        r = min(n, s.length("residual"))
        s.crop("residual", s.length("residual") - r)
        n -= r
        q = min(n, s.length("token"))
        if q:
            kept = s.length("token") - q
            G = self.k_codec.group
            full = kept // G * G
            if kept > full:  # the partial block's kept tokens go back to the residual as full precision
                keys, values = self.read()
                S = s.length("sink")
                back_k, back_v = keys[:, :, S + full:S + kept], values[:, :, S + full:S + kept]
                s.crop("residual", 0)
                self._append_window(back_k, back_v)
            s.crop("token", full)
            if s.names("block"):
                s.crop("block", full // G)
            n -= q
        if n:
            s.crop("sink", s.length("sink") - n)

    def memory(self) -> CacheMemory:
        """Bytes held by this layer (the RoPE helper, shared by the layers of a cache, is counted by the cache)."""
        rotation = self._rotation.nbytes() if self._owns_rotation else 0  # else the cache counts it, once
        if not self.is_initialized:
            return CacheMemory(codebooks=_nbytes(self.consts["k"]["codebook"], self.consts["v"]["codebook"]),
                               scales=_nbytes(self.consts["k"].get("static_zero"),
                                              self.consts["k"].get("static_scale")), rotation=rotation)
        parts = self.store.nbytes()
        return CacheMemory(
            packed=parts["packed"], scales=parts["scales"] + _nbytes(self.consts["k"].get("static_zero"),
                                                                     self.consts["k"].get("static_scale")),
            outliers=parts["outliers"], full_precision=parts["full_precision"],
            codebooks=_nbytes(self.consts["k"]["codebook"], self.consts["v"]["codebook"],
                              *(c.get("codebook") for c in self.window_consts or ())),
            positions=_nbytes(self.first), reserved=parts["reserved"], tokens=self.stored_length(), rotation=rotation,
        )


def _check_calibration_options(cfg: QuantCacheConfig, calibrated: bool) -> None:
    """Options that do not combine with a calibration file's levels: a second source of levels, or no stream left
    that the levels were fitted for (`QuantCacheConfig.codebook_streams`)."""
    if not calibrated or not cfg.codebooks:
        return
    if cfg.levels != "uniform":
        raise ValueError(f"levels={cfg.levels!r} with a calibration file's codebooks (codebooks=True) gives two sources "
                         "of levels; allowed: codebooks=False (data-free levels) or levels='uniform' (the file's)")
    if not cfg.codebook_streams():
        raise ValueError(f"codebooks=True, but rotation={cfg.rotation!r} with rotate={cfg.rotate!r} and v_scale="
                         f"{cfg.v_scale!r} leaves no stream the file's codebooks were fitted for (unrotated keys; "
                         "unrotated values with v_scale='minmax'); allowed: codebooks=False, rotate='v' (keys take "
                         "their codebooks) or rotation='none'")


def _write_planes(out: torch.Tensor, planes: list[torch.Tensor]) -> None:
    """Channel planes [..., w] side by side into `out` [..., D] (cast to its dtype)."""
    a = 0
    for p in planes:
        out[..., a:a + p.shape[-1]] = p
        a += p.shape[-1]


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer (full precision, `sliding_layers="native"`) that holds its window only.

    transformers keeps the window as a view into the concatenation of the window and the new states, so after a
    prefill chunk of n tokens a layer holds n + window tokens until its next update (after a one-shot 32k prefill,
    32k tokens per sliding layer). When the view holds less than two thirds of its storage, this layer keeps a
    compact copy of the window instead; decode steps (a storage one token longer than the window) copy nothing.
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if not self.record_past and self.keys.numel() * self.keys.element_size() * 3 < \
                2 * self.keys.untyped_storage().nbytes():
            self.keys, self.values = self.keys.clone(), self.values.clone()
        return keys, values


def _dynamic_layer_memory(layer) -> CacheMemory:
    """A transformers layer kept in full precision (native sliding window): its keys/values, and its other tensors
    (e.g. the window size as a tensor) as bookkeeping."""
    other = [t for name, t in vars(layer).items() if isinstance(t, torch.Tensor) and name not in ("keys", "values")]
    if not getattr(layer, "is_initialized", False) or layer.keys is None:
        return CacheMemory(positions=_nbytes(*other))
    return CacheMemory(full_precision=_nbytes(layer.keys, layer.values), positions=_nbytes(*other),
                       tokens=layer.keys.shape[-2] if layer.keys.dim() == 4 else 0)


class QuantCache(Cache):
    """A quantized KV cache for `model.generate` and plain forward passes.

    Keys are stored pre-RoPE, quantized per channel over blocks of `k_group_size` tokens; values per token in groups
    of `v_group_size` channels; both bit-packed. Attention reads what the cache holds (dequantized).

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
        self.calibration: CalibrationData | None = calibration
        if options is None:
            given = {k: v for k, v in kwargs.items() if v is not None}
            if calibration is not None:  # the file's recipe, the options given replacing its fields
                bits = given.pop("bits", None)
                if bits is not None:
                    given = {"k_bits": bits, "v_bits": bits, **given}
                options = dataclasses.replace(calibration.recipe, **given)
            else:
                options = recipe(preset=preset, **given)
        _check_calibration_options(options, calibration is not None)
        if options.static_keys and calibration is None:
            raise ValueError("static_keys=True needs a calibration file (calibration=path); allowed without one: "
                             "static_keys=False")
        self.options = options
        super().__init__(layers=[])
        self._fingerprint: dict | None = None
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
        self._rotation = (SharedRotation(fingerprint["head_dim"], self.options.rotation_seed)
                          if self.options.rotation != "none" else None)
        layers = []
        for idx, layer_type in enumerate(layer_types):
            calib = self.calibration.layer(idx) if self.calibration is not None else None
            if layer_type == "full_attention":
                layers.append(QuantLayer(self.options.for_layer(idx), idx, rope, calibration=calib,
                                         rotation=self._rotation))
            elif layer_type == "sliding_attention":
                window = text_config.sliding_window
                if self.options.sliding_layers == "native":
                    layers.append(SlidingWindowLayer(sliding_window=window))
                else:  # a window-only layer quantizes tokens one by one: no calibrated levels or ranges apply
                    own = self.options.for_sliding_layer(idx)
                    layers.append(QuantLayer(own, idx, rope, sliding_window=window,
                                             calibration=None if own.holds_window_only() else calib,
                                             rotation=self._rotation))
            else:
                raise ValueError(
                    f"layer {idx} of model_type={fingerprint['model_type']!r} has layer type {layer_type!r}; "
                    "QuantCache supports: ['full_attention', 'sliding_attention']"
                )
        self.layers = layers
        self._fingerprint = fingerprint
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
            diff = {k: (self._fingerprint[k], fingerprint[k]) for k in fingerprint if fingerprint[k] != self._fingerprint[k]}
            raise ValueError(
                f"this QuantCache was built for another model (held, got): {diff}; use a new QuantCache per model "
                "(or reset() it)"
            )
        self._config_obj = config

    def _check_geometry(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Every update: the states must fit the model this cache was built for."""
        if key_states.shape[-1] != value_states.shape[-1]:
            raise ValueError(
                f"layer {layer_idx} hands the cache keys with head_dim {key_states.shape[-1]} and values with head_dim "
                f"{value_states.shape[-1]}; QuantCache needs one head_dim for both (multi-head latent attention caches "
                "its latent and rotary part instead of keys and values)"
            )
        fp = self._fingerprint
        if layer_idx >= len(self.layers):
            raise ValueError(f"layer_idx={layer_idx} but the model this QuantCache was built for has {len(self.layers)} "
                             "layers; use a new QuantCache per model")
        heads = fp["num_key_value_heads"]
        if key_states.dim() == 4 and key_states.shape[1] * tensor_parallel_ranks() == heads:
            heads = key_states.shape[1]  # a tensor-parallel rank holds its share of the KV heads
        if key_states.dim() != 4 or key_states.shape[1] != heads or key_states.shape[-1] != fp["head_dim"]:
            raise ValueError(
                f"key_states of shape {tuple(key_states.shape)} at layer {layer_idx}, but this QuantCache was built for "
                f"[batch, {fp['num_key_value_heads']} kv heads, tokens, head_dim {fp['head_dim']}] "
                f"({fp['model_type']}); use a new QuantCache per model"
            )
        if key_states.shape[1] != fp["num_key_value_heads"] and self.options.static_keys:
            raise ValueError(
                f"static_keys=True holds calibrated key ranges for all {fp['num_key_value_heads']} kv heads, but this "
                f"process computes {key_states.shape[1]} of them (tensor parallelism); allowed here: static_keys=False")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._fingerprint is None or layer_idx == 0:
            self._check_caller(layer_idx)
        self._check_geometry(key_states, value_states, layer_idx)
        if layer_idx == 0:
            # decode attention from the codes only when the model's attention is the one that knows how; read from the
            # bound config every forward (set_attn_implementation may change it between calls)
            fused = getattr(self._config_obj, "_attn_implementation", None) == FUSED_ATTENTION
            for layer in self.layers:
                if isinstance(layer, QuantLayer):
                    layer.fused_attention = fused
        layer = self.layers[layer_idx]
        if isinstance(layer, QuantLayer) and layer.cfg.rotate == "auto":
            self._choose_key_rotation(layer, key_states)
        return layer.update(key_states, value_states, *args, **kwargs)

    def _choose_key_rotation(self, layer: "QuantLayer", key_states: torch.Tensor) -> None:
        """rotate="auto": decide whether `layer` rotates its keys, from the weights of the attention module calling
        update (qcache/keyrot.py). Raises if that module cannot be found or lacks dense q_proj/k_proj weights."""
        from .keyrot import key_rotation_ratio, rotary_width, weight_energies

        idx = layer.layer_idx
        try:
            module = attention_module_on_stack(idx)
            if module is None or getattr(module, "config", None) is None:
                raise ValueError(
                    f"rotate='auto' decides per layer from the attention module's q_proj/k_proj weights, and no "
                    f"attention module of layer {idx} was found up the call stack of Cache.update (called outside a "
                    "model forward?); allowed without one: rotate='v' (keys unrotated) or rotate='kv'")
            tc = self._text_config
            kv_heads = key_states.shape[1]  # this process's share under tensor parallelism
            heads = tc.num_attention_heads * kv_heads // self._fingerprint["num_key_value_heads"]
            q_energy, k_energy = weight_energies(module, heads, kv_heads, self._fingerprint["head_dim"],
                                                 rotary_width(tc, layer.rope, idx))
            ratio = key_rotation_ratio(q_energy, k_energy, self._rotation.on(q_energy.device))
        except ValueError as err:
            # no weights to decide by: this layer keeps its keys unrotated (the measured-safe side), said once per
            # cache and reported by `key_rotation`
            if not self._warned_key_rotation:
                logger.warning("%s. Keeping keys unrotated where this happens; pass rotate='v' to say so or "
                               "rotate='kv' to rotate them.", str(err).split("; allowed")[0])
                self._warned_key_rotation = True
            ratio = None
        layer.choose_key_rotation(ratio)
        logger.debug("layer %d: keys %s (estimated rotated/unrotated score error %.3f)", idx,
                     "rotated" if "k" in layer.cfg.rotate else "unrotated",
                     ratio if ratio is not None else float("nan"))

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

    # -- reporting -------------------------------------------------------------------------------------------
    def memory(self) -> CacheMemory:
        """Bytes held, by kind (`CacheMemory`): `total` is every byte of every tensor reachable from the cache."""
        total = CacheMemory()
        for layer in self.layers:
            total = total + (layer.memory() if isinstance(layer, QuantLayer) else _dynamic_layer_memory(layer))
        rope = next((layer.rope for layer in self.layers if isinstance(layer, QuantLayer) and layer.rope), None)
        if rope is not None:
            total.rope += rope.nbytes()
        if self._rotation is not None:
            total.rotation += self._rotation.nbytes()
        if self.calibration is not None:  # the layers' tensors, counted once: only those no layer uses yet
            used = {id(t) for layer in self.layers if isinstance(layer, QuantLayer)
                    for consts in layer.consts.values() for t in consts.values() if t is not None}
            total.codebooks += _nbytes(*(t for layer in self.calibration.layers.values() for t in layer.values()
                                         if id(t) not in used))
        return total

    def __repr__(self) -> str:
        return f"QuantCache({self.options}, layers={len(self.layers)})"
