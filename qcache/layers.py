"""The layers of a `QuantCache`, one class per storage mode, over one `PackedStore` each.

    ===================== ================================================================================
    class                 holds
    ===================== ================================================================================
    `BlockLayer`          sinks (first `sink_tokens`, as given) | quantized key blocks of `k_group_size`
                          tokens: pre-RoPE codes, one scale/zero per channel per block (`KeyCodec`); values
                          per token in groups of `v_group_size` channels (`ValueCodec`) | the residual: the
                          block being filled and `recent_tokens`, as given or 8-bit per token and head
                          (`window_bits=8`; until the layer first quantizes a block its tokens are held as
                          given: "early"). A sliding layer of this kind drops whole blocks out of its window.
    `TokenWindowLayer`    a sliding layer's window only, every token quantized on its own as it arrives
                          (`layout.token_codecs`), trimmed token by token (`QuantCacheConfig.holds_window_only`)
    `SlidingWindowLayer`  a sliding layer in full precision (`sliding_layers="native"`)
    ===================== ================================================================================

`QuantLayer` is what the first two share: the store and its bytes, the positions of each row (one consecutive run
per row, left padding allowed, kept as the position of each row's first token), the residual's token codecs and
transformers' layer contract (lengths, masks, batch operations). Tokens move from the residual to the quantized
region G at a time, once, and are never re-quantized. `update()` returns what the layer holds: dequantized keys (RoPE
re-applied) and values for the quantized region, the stored tokens elsewhere, or at a decode step the handover of
qcache/handover.py, which attention reads from the codes.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import weakref
from dataclasses import dataclass, fields

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from . import kernels, layout, native, triton_decode
from .binding import positions_from_kwargs
from .codec import ValueCodec
from .config import QuantCacheConfig
from .handover import DecodeStep
from .kernels import Quantized
from .levels import gaussian_levels_tensor, levels_tensor
from .rope import RopeHelper
from .rotation import SharedRotation
from .store import PackedStore

__all__ = ["CacheMemory", "QuantLayer", "BlockLayer", "TokenWindowLayer", "SlidingWindowLayer", "make_layer",
           "layer_memory", "check_calibration_options"]

logger = logging.getLogger(__name__)


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
    """What `BlockLayer` and `TokenWindowLayer` share (the module docstring). Subclasses build their codecs in
    `_configure` and their store in `_build`, and define `update`, `read` and `crop`.

    Args:
        cfg: the layer's recipe.
        layer_idx: index of the layer in the model.
        rope: the model's RoPE (None: keys stored as attention produced them, `rope="post"`).
        sliding_window: the window of a sliding-attention layer (None: full attention).
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
        self.layer_idx, self.rope = layer_idx, rope
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self._calibration = calibration or {}
        self._rotation, self._owns_rotation = rotation, False
        self.key_rotation_ratio: float | None = None  # rotate="auto": the estimate the choice was made on
        self.consts: dict[str, dict] = {"k": {}, "v": {}}  # the key and value codecs' constants
        self._handed: weakref.ref | None = None  # the decode step last handed to attention (qcache/handover.py)
        self._configure(cfg)
        self._clear()

    def _configure(self, cfg: QuantCacheConfig) -> None:
        self.cfg = cfg

    def _settle(self) -> None:
        """Before this layer changes: a decode step handed out and still referenced keeps what it showed."""
        step = self._handed() if self._handed is not None else None
        if step is not None and step.live:
            step.settle()
        self._handed = None

    def _clear(self) -> None:
        self._settle()
        self.is_initialized = False
        self.keys = self.values = None  # unused: kept for transformers code that peeks at them
        self.store: PackedStore | None = None
        self.first: torch.Tensor | None = None  # [B] int64: position of each row's first stored token
        self.dropped = 0  # tokens evicted from the front (sliding layers)
        self.cumulative_length = 0  # tokens ever seen (what sliding masks count)
        self.window_codecs = self.window_consts = None  # the residual's token codecs and their constants, if any

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape  # [B, H, T, D]
        self.dtype, self.device, self.head_dim = key_states.dtype, key_states.device, D
        self.v_head_dim = value_states.shape[-1]  # values may be wider than keys (MiMo-V2-Flash)
        if self.cfg.uses_rotation() and self._rotation is None:
            self._rotation, self._owns_rotation = SharedRotation(D, self.cfg.rotation_seed), True
        self._in_c = self._codes_in_c()
        self.store = self._build(B, H, D)
        self.window_consts = None if self.window_codecs is None else self._token_consts(self.window_codecs)
        for consts in self.consts.values():
            for name, t in consts.items():
                if t is not None and t.device != self.device:
                    consts[name] = t.to(self.device)
        self.is_initialized = True

    def _build(self, batch: int, heads: int, head_dim: int) -> PackedStore:
        raise NotImplementedError

    def _token_consts(self, codecs: tuple[ValueCodec, ValueCodec]) -> tuple[dict, dict]:
        """The constants of residual token codecs: the rotation of a rotated one, the Gaussian levels of the "norm"
        form (which is rotated)."""
        consts = []
        for codec, width in zip(codecs, (self.head_dim, self.v_head_dim)):
            c = {"rotation": self._rotation.on(self.device, width)} if codec.rotation else {}
            if codec.norm:
                c["codebook"] = gaussian_levels_tensor(codec.bits).to(self.device)
            consts.append(c)
        return tuple(consts)

    def _admit(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict) -> tuple[int, int | None]:
        """Start an update of T tokens: initialize, check the states and place them after each row's run. Returns T
        and, for a sliding layer, how many held tokens this step's queries see besides the new ones."""
        self._settle()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif (key_states.shape[0] != self.store.batch or key_states.shape[1] != self.store.heads
              or key_states.shape[-1] != self.head_dim or value_states.shape[-1] != self.v_head_dim):
            raise ValueError(
                f"layer {self.layer_idx} holds batch {self.store.batch} x {self.store.heads} heads x head_dim "
                f"{self.head_dim} (values {self.v_head_dim}) but got key_states of shape {tuple(key_states.shape)} and "
                f"value_states of shape {tuple(value_states.shape)}; call reset() before reusing the cache")
        B, _, T, _ = key_states.shape
        position_ids = positions_from_kwargs(kwargs)
        if position_ids is None:
            # attention passed none (GPT-NeoX, Falcon, StableLM, ...): the tokens' places in the cache stand in for
            # them. RoPE is undone and redone at the same positions, so the keys read back are exact whatever the
            # model's own positions were; where those are the cache's places plus a constant per row (left padding)
            # the stored keys are pre-RoPE keys turned by that row's constant angle, as position-free as pre-RoPE
            position_ids = torch.arange(self.cumulative_length, self.cumulative_length + T, device=self.device)[None]
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq]; got shape {tuple(position_ids.shape)}")
        given = position_ids.to(self.device).expand(B, T)
        if self.first is None:  # each row's run ends at its last token
            self.first = (given[:, -1] - (T - 1)).long()
        # a decode step of one row continuing its run is checked on Python ints (the general check costs ~20 ops)
        if not (B == 1 and T == 1 and int(given) == int(self.first) + self.cumulative_length):
            _consecutive_positions(given, self.first, self.cumulative_length)
        kv_before = self.get_mask_sizes(T)[0] - T if self.is_sliding else None
        self.cumulative_length += T
        return T, kv_before

    def _key_order(self, x: torch.Tensor) -> torch.Tensor:
        """Keys (or queries) [..., D] in the model's channel order -> the order the layer keeps keys in: RoPE pairs
        as rotate-half halves (`RopeHelper.to_pairs`; x itself unless the model interleaves its pairs)."""
        return x if self.rope is None else self.rope.to_pairs(x)

    def _model_order(self, keys: torch.Tensor) -> torch.Tensor:
        """Inverse of `_key_order`: keys as the model's attention expects them."""
        return keys if self.rope is None else self.rope.from_pairs(keys)

    def _append_window(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append tokens (cache dtype, keys after RoPE) to the residual, through its token codecs if it has them.
        A layer with token codecs that holds no quantized and no coded residual token yet keeps them as given
        ("early"): a prompt that never fills a block is held exactly; `_code_early` codes them once one would."""
        s = self.store
        if self.window_codecs is None:
            s.append("residual", res_k=k, res_v=v)
            return
        if s.names("early") and s.length("token") == 0 and s.length("residual") == 0:
            s.append("early", early_k=k, early_v=v)
            return
        self._code_window(k, v)

    def _code_window(self, k: torch.Tensor, v: torch.Tensor) -> None:
        (ck, cv), (kc, vc) = self.window_codecs, self.window_consts
        fit = {"fit": native.encode_tokens} if self._in_c else {}
        self.store.append("residual", **ck.encode(k.float(), kc, **fit), **cv.encode(v.float(), vc, **fit))

    def _codes_in_c(self) -> bool:
        """Whether this layer codes tokens with qcache's C encoder (`native.encode_tokens`, `native.encode_keys`):
        where its kernel is "native", or "auto" on a CPU where the C kernels build; else torch codes them. Decided
        once, at the layer's first update."""
        if self.device.type != "cpu":
            return False
        kernel = self.cfg.kernel
        if kernel == "auto":
            kernel = kernels._forced() or "auto"
        return kernel == "native" or (kernel == "auto" and native.available())

    def _code_early(self) -> None:
        """Move the early tokens into the coded residual (the codes they would have had from the start: each
        token is coded on its own)."""
        s = self.store
        self._code_window(s.view("early_k"), s.view("early_v"))
        s.clear("early")

    def _window(self, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual's keys (after RoPE) and values [B, H, R, D] in the cache dtype (the early tokens while
        there are any: the coded residual is empty then); with `n`, its first n tokens only."""
        s = self.store
        if self.window_codecs is None:
            return s.view("res_k")[:, :, :n], s.view("res_v")[:, :, :n]
        if s.length("early"):
            return s.view("early_k")[:, :, :n], s.view("early_v")[:, :, :n]
        codes = self._window_codes()
        if n is not None:
            codes = tuple({name: t[:, :, :n] for name, t in parts.items()} for parts in codes)
        return tuple(torch.cat(c.planes(parts, consts), dim=-1).to(self.dtype)
                     for c, parts, consts in zip(self.window_codecs, codes, self.window_consts))

    def _window_codes(self) -> tuple[dict, dict]:
        """The coded residual's key and value parts, {part name: view [B, H, R, ...]} each."""
        views = self.store.views("residual")
        return tuple({n: t for n, t in views.items() if n.startswith(c.prefix)} for c in self.window_codecs)

    @property
    def quantized_length(self) -> int:
        return 0 if not self.is_initialized else self.store.length("token")

    def stored_length(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(self.store.length(a) for a in ("sink", "token", "residual", "early"))

    def _check_crop(self, tokens_to_remove: int) -> int:
        """The number of tokens a `crop(tokens_to_remove)` removes (a negative int, as for `DynamicLayer`)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as for DynamicLayer")
        self._settle()
        if not self.is_initialized:
            return 0
        if -tokens_to_remove and self.is_sliding and self.cumulative_length >= self.sliding_window:
            raise ValueError("cannot crop a quantized sliding-window layer once its window is full")
        n = min(-tokens_to_remove, self.stored_length())
        self.cumulative_length -= n
        return n

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
        self._settle()
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

    def fork(self) -> "QuantLayer":
        """An independent copy (`QuantCache.fork`): its own store, positions and counters; the recipe, codecs and
        constant tensors (never written in place once the layer holds tokens) shared."""
        new = copy.copy(self)
        new._handed, new.consts = None, {stream: dict(c) for stream, c in self.consts.items()}
        if self.is_initialized:
            new.store, new.first = self.store.clone(), self.first.clone()
        return new

    def const_tensors(self) -> list[torch.Tensor]:
        """The codecs' constant tensors this layer holds (levels, static key ranges)."""
        out = [t for consts in self.consts.values() for n, t in consts.items() if t is not None and n != "rotation"]
        return out + [t for c in (self.window_consts or ()) for n, t in c.items() if n == "codebook"]

    def memory(self) -> CacheMemory:
        """Bytes held by this layer (the RoPE helper, shared by the layers of a cache, is counted by the cache)."""
        return layer_memory(self)


class BlockLayer(QuantLayer):
    """Sinks | quantized key blocks (and their values) | the residual (the module docstring's table)."""

    def _configure(self, cfg: QuantCacheConfig) -> None:
        """Take `cfg` as this layer's recipe: its constants and key codec (the value codec needs head_dim and is
        built at the first update)."""
        self.cfg = cfg
        k_consts, v_consts = _block_constants(cfg, self._calibration, self.layer_idx)
        self.consts = {"k": k_consts, "v": v_consts}
        self.k_codec = layout.key_codec(cfg, codebook=k_consts["codebook"] is not None)
        self.v_codec: ValueCodec | None = None
        self.sink_tokens = 0 if self.is_sliding else cfg.sink_tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        # whether a decode step hands qcache's C kernel the 8-bit window as its codes (fixed by the codecs)
        self._reads_window_codes = (self.decode_kernel == "native" and self.device.type == "cpu"
                                    and native.window_unsupported(self.window_codecs, self.window_consts) is None)

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

    def _build(self, batch: int, heads: int, head_dim: int) -> PackedStore:
        if self.cfg.rotate == "auto":  # no QuantCache chose it from the model's weights
            logger.warning("layer %d: a QuantLayer used on its own with rotate='auto': keys unrotated (no model "
                           "weights to decide by); pass rotate='v' to say so or rotate='kv'", self.layer_idx)
            self.choose_key_rotation(None)
        cfg = self.cfg
        v_dim = self.v_head_dim
        self.v_codec = layout.value_codec(cfg, v_dim, calibrated_levels=self.consts["v"]["codebook"] is not None)
        if cfg.v_scale == "norm":
            self.consts["v"]["codebook"] = gaussian_levels_tensor(cfg.v_bits)
        elif cfg.levels == "lloyd-max":
            self.consts["v"]["codebook"] = levels_tensor(cfg.v_bits, self.v_codec.group, cfg.outliers)
        if cfg.rotation != "none":
            for stream in cfg.rotate:  # "k" and/or "v"
                self.consts[stream]["rotation"] = self._rotation.on(self.device, {"k": head_dim, "v": v_dim}[stream])
        # the read ("eager" or "compiled") and the decode step's attention from the codes (None: attention reads)
        self.kernel, self.decode_kernel = kernels.resolve_decode(cfg.kernel, self.device, self.k_codec, self.v_codec,
                                                                 head_dim, self.consts["k"], v_dim)
        self.window_codecs = layout.window_codecs(cfg, head_dim, False, v_dim)  # 8-bit tokens, or None: as given
        G = self.k_codec.group
        parts = layout.layer_parts(self.k_codec, self.v_codec, self.window_codecs, head_dim, self.dtype, v_dim)
        # between two flushes the residual holds at most the recent window + one block
        return PackedStore(parts, batch, heads, self.device,
                           min_grow={"token": max(G, 16), "block": 1, "sink": max(self.sink_tokens, 1),
                                     "residual": G, "early": G},
                           bounded={"sink": self.sink_tokens, "residual": cfg.recent_tokens + G,
                                    "early": 0})  # (early: freed once coded)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new states and return all keys/values as the layer now holds them ([B, H, T_total, D]); into
        an empty layer, the states as given (a prefill attends to what it computed); at a decode step with the
        compiled kernel, the handover (qcache/handover.py)."""
        T, kv_before = self._admit(key_states, value_states, kwargs)
        fresh = self.stored_length() == 0  # nothing held before: the prefill attends to its own states as computed
        given_k, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        key_states = self._key_order(given_k)
        s = self.store
        n_sink = 0
        if s.length("token") + s.length("residual") + s.length("early") == 0:
            n_sink = max(min(self.sink_tokens - s.length("sink"), T), 0)
        s.append("sink", sink_k=key_states[:, :, :n_sink], sink_v=value_states[:, :, :n_sink])
        self._append_window(key_states[:, :, n_sink:], value_states[:, :, n_sink:])
        self._flush()
        if T == 1 and self.decode_kernel is not None and not self.is_sliding and s.length("token") > 0:
            if self._reads_window_codes and not s.length("early"):
                # the C kernel reads the 8-bit window from its codes: only the sinks are handed over as tensors
                window = native.Window(*self._window_codes(), *self.window_codecs, *self.window_consts)
                step = DecodeStep(self, s.view("sink_k"), s.view("sink_v"), self.stored_length(), window)
            else:
                res_k, res_v = self._window()
                fp_k, fp_v = torch.cat([s.view("sink_k"), res_k], dim=2), torch.cat([s.view("sink_v"), res_v], dim=2)
                step = DecodeStep(self, fp_k, fp_v, self.stored_length())
            self._handed = weakref.ref(step)
            return step.states()
        if fresh:
            keys, values = given_k, value_states
        else:
            keys, values = self._held()
            keys = self._model_order(keys)
            if self.is_sliding:
                keys, values = keys[:, :, -(kv_before + T):], values[:, :, -(kv_before + T):]
        if self.is_sliding:
            self._evict()
        return keys, values

    def _flush(self) -> None:
        """Quantize whole blocks of G tokens out of the residual, keeping `recent_tokens` as they are."""
        s = self.store
        G = self.k_codec.group
        if s.length("early") - self.cfg.recent_tokens >= G:  # a block is due: the early tokens take their codes
            self._code_early()
        n = (s.length("residual") - self.cfg.recent_tokens) // G * G
        if n <= 0:
            return
        k, v = self._window(n)  # [B, H, n, D]
        # positions of these tokens: they follow the sinks and the quantized region of their row
        start = s.length("sink") + self.dropped + s.length("token")
        p = self.first[:, None] + start + torch.arange(n, device=self.device)  # [B, n]
        valid = (p >= 0)[:, None, :, None]  # [B, 1, n, 1]: padding stays out of the statistics
        k = self.rope.undo(k, p, self.layer_idx) if self.rope is not None else k.float()  # fp32, pre-RoPE
        if self._in_c:
            k_fit, v_fit = {"fit": native.encode_keys}, {"fit": native.encode_tokens}
        else:
            k_fit = {}
            v_fit = ({"nearest": kernels.compiled("nearest_levels", self.v_codec.bits)}
                     if self.kernel == "compiled" and self.v_codec.norm else {})
        parts = (self.k_codec.encode(k, self.consts["k"], valid, **k_fit)
                 | self.v_codec.encode(v.float(), self.consts["v"], **v_fit))
        for axis in ("token", "block"):
            s.append(axis, **{name: t for name, t in parts.items() if s.parts[name].axis == axis})
        s.drop_front("residual", n)

    def _evict(self) -> None:
        """Sliding layers: drop whole quantized blocks (tokens for static keys) that no future query can see."""
        s = self.store
        G = self.k_codec.group
        drop = min(max(self.stored_length() - (self.sliding_window - 1), 0), s.length("token")) // G * G
        if drop:
            s.drop_front("token", drop)
            if s.names("block"):
                s.drop_front("block", drop // G)
            self.dropped += drop
        for axis in ("early", "residual"):  # only full-precision tokens left: trim them exactly
            surplus = min(self.stored_length() - (self.sliding_window - 1), s.length(axis))
            if s.length("token") == 0 and surplus > 0:
                s.drop_front(axis, surplus)
                self.dropped += surplus

    @property
    def _kernel_variant(self) -> tuple:
        """What makes the compiled functions' code differ between caches (each gets its own compile budget)."""
        return (self.k_codec, self.v_codec, self.rope is not None, self.dtype)

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

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE applied) and values as the layer holds them, in the cache dtype: [sinks | dequantized |
        residual], [B, H, T_stored, D]."""
        keys, values = self._held()
        return self._model_order(keys), values

    def _held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`read` with the keys' channels in the order the layer keeps them (`_key_order`)."""
        s = self.store
        sink_k, sink_v = s.view("sink_k"), s.view("sink_v")
        res_k, res_v = self._window()
        if s.length("token") == 0:
            return torch.cat([sink_k, res_k], dim=2), torch.cat([sink_v, res_v], dim=2)
        q = self._quantized()
        if self.kernel == "compiled":
            return (kernels.compiled("read_keys", self._kernel_variant)(sink_k, q, res_k, self.k_codec),
                    kernels.compiled("read_values", self._kernel_variant)(sink_v, q, res_v, self.v_codec))
        S, Tq, R = sink_k.shape[2], s.length("token"), res_k.shape[2]
        keys = res_k.new_empty(*res_k.shape[:2], S + Tq + R, res_k.shape[-1])
        values = res_v.new_empty(*keys.shape[:3], res_v.shape[-1])
        keys[:, :, :S], keys[:, :, S + Tq:] = sink_k, res_k
        values[:, :, :S], values[:, :, S + Tq:] = sink_v, res_v
        _write_planes(keys[:, :, S:S + Tq], kernels.key_planes(q, self.k_codec))
        _write_planes(values[:, :, S:S + Tq], self.v_codec.planes(q.v, q.v_consts))
        return keys, values

    def decode_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None,
                         fp_states: tuple[torch.Tensor, torch.Tensor], window=None) -> torch.Tensor:
        """fp32 attention of the query rows [B, H, G, D] of each kv head over everything held, from the codes
        (`kernels.decode_attention`); attention_mask: None, bool (True = attend) or additive, [B or 1, 1, 1,
        T_held]; fp_states: the [sinks | residual] keys and values of this step, or with `window` (the residual's
        codes, `native.Window`, read by the C kernel) the sinks alone. Returns [B, H, G, D] fp32."""
        s = self.store
        S, Tq, R = s.length("sink"), s.length("token"), s.length("residual")
        if attention_mask is not None and (attention_mask.shape[-1] != S + Tq + R
                                           or attention_mask.shape[1:3] != (1, 1)):
            raise ValueError(
                f"layer {self.layer_idx}: attention mask of shape {tuple(attention_mask.shape)} for "
                f"{S + Tq + R} cached tokens; fused decode attention needs [B, 1, 1, {S + Tq + R}]")
        fp_k, fp_v = fp_states
        if fp_k.shape[2] != S + (0 if window is not None else R):
            raise ValueError(f"layer {self.layer_idx}: got {fp_k.shape[2]} full-precision tokens, the layer holds "
                             f"{S + R}: pass the DecodeStep of this step")
        D = query.shape[-1]
        scaling = D**-0.5 if scaling is None else scaling
        native_cpu = self.decode_kernel == "native" and query.device.type == "cpu"
        if window is not None and not native_cpu:
            raise ValueError(f"layer {self.layer_idx}: a window of codes is read by the C kernel only")
        if native_cpu:  # the C kernel takes the mask as it is (bool or additive, batch 1 broadcast)
            return native.decode_attention(self._key_order(query.float()), fp_k, fp_v, attention_mask,
                                           self._quantized(), S, scaling, self.k_codec, self.v_codec, window)
        bias = None
        if attention_mask is not None:
            bias = attention_mask.float()
            if attention_mask.dtype == torch.bool:
                bias = torch.zeros_like(bias).masked_fill_(~attention_mask, torch.finfo(torch.float32).min)
            bias = bias.expand(query.shape[0], 1, 1, S + Tq + R)
        if self.decode_kernel == "native":
            fn = triton_decode.decode_attention
        else:
            fn = kernels.compiled("decode_attention", self._kernel_variant)
        return fn(self._key_order(query.float()), fp_k, fp_v, bias, self._quantized(), S, scaling, self.k_codec,
                  self.v_codec)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a negative int, as for `DynamicLayer`).

        Whole key blocks that stay keep their codes and scales. A crop through a key block (assisted decoding's
        rollback) takes the block's kept tokens back into the residual with the values they were stored with
        (dequantized, RoPE re-applied, in the cache dtype) and forgets the block's codes and scales, so nothing of the
        removed tokens stays in any kept range; the block is quantized again once it refills."""
        n = self._check_crop(tokens_to_remove)
        if n == 0:
            return
        s = self.store
        for axis in ("early", "residual"):  # (only one of them holds tokens)
            r = min(n, s.length(axis))
            s.crop(axis, s.length(axis) - r)
            n -= r
        q = min(n, s.length("token"))
        if q:
            kept = s.length("token") - q
            G = self.k_codec.group
            full = kept // G * G
            if kept > full:  # the partial block's kept tokens go back to the residual as full precision
                keys, values = self._held()
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


class TokenWindowLayer(QuantLayer):
    """A sliding layer holding only its window, every token quantized on its own as it arrives, at the recipe's
    key and value widths (8-bit min-max; below 8 bits rotated onto Gaussian levels with one scale, or min-max per
    group unrotated: `QuantCacheConfig.token_form`), trimmed token by token. No key blocks, so no sinks, no
    calibrated levels and no key rotation to choose."""

    def _configure(self, cfg: QuantCacheConfig) -> None:
        # rotate="auto" decides for key blocks; this layer's tokens have codecs of their own
        self.cfg = dataclasses.replace(cfg, rotate="v") if cfg.rotate == "auto" else cfg
        self.sink_tokens = 0
        if cfg.static_keys:
            raise ValueError(
                f"static_keys=True, but sliding layer {self.layer_idx} holds its window as tokens quantized one by one "
                f"(sliding_layers={cfg.sliding_layers!r} at {cfg.k_bits}/{cfg.v_bits} bits), which take no static key "
                "ranges; allowed: static_keys=False, or sliding_layers='quantized' below 8 bits or 'native'")

    def _build(self, batch: int, heads: int, head_dim: int) -> PackedStore:
        self.window_codecs = layout.window_codecs(self.cfg, head_dim, True, self.v_head_dim)
        parts = layout.window_parts(self.window_codecs, head_dim, self.dtype, self.v_head_dim)
        return PackedStore(parts, batch, heads, self.device, min_grow={"residual": self.cfg.k_group_size},
                           bounded={"residual": self.sliding_window})

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens and return the window this step's queries see ([B, H, T_seen, D])."""
        T, kv_before = self._admit(key_states, value_states, kwargs)
        fresh = self.stored_length() == 0  # nothing held before: the prefill attends to its own states as computed
        key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        self._append_window(self._key_order(key_states), value_states)
        if fresh:
            keys, values = key_states, value_states
        else:
            keys, values = (t[:, :, -(kv_before + T):] for t in self._window())
            keys = self._model_order(keys)
        surplus = self.stored_length() - (self.sliding_window - 1)  # no future query sees these
        if surplus > 0:
            self.store.drop_front("residual", surplus)
            self.dropped += surplus
        return keys, values

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's keys (after RoPE) and values, dequantized, [B, H, T_stored, D] in the cache dtype."""
        keys, values = self._window()
        return self._model_order(keys), values

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a negative int), before the window has filled."""
        n = self._check_crop(tokens_to_remove)
        if n:
            self.store.crop("residual", self.store.length("residual") - n)


def _block_constants(cfg: QuantCacheConfig, calibration: dict, layer_idx: int) -> tuple[dict, dict]:
    """The key and value codecs' constants of a block layer known before its first update: a calibration file's
    levels on the streams they were fitted for, its static key ranges, data-free key levels (checked against `cfg`)."""
    check_calibration_options(cfg, bool(calibration))
    streams = cfg.codebook_streams() if cfg.codebooks else ""  # the streams the file's levels were fitted for
    k_consts = {"codebook": calibration.get("k_codebook") if "k" in streams else None}
    v_consts = {"codebook": calibration.get("v_codebook") if "v" in streams else None}
    for name, cb, bits in (("k_codebook", k_consts["codebook"], cfg.k_bits),
                           ("v_codebook", v_consts["codebook"], cfg.v_bits)):
        if cb is not None and cb.numel() != 2**bits:
            raise ValueError(f"layer {layer_idx}: calibrated {name} has {cb.numel()} levels but {bits} bits "
                             f"need {2**bits}; calibrate for these bits or pass codebooks=False")
    if cfg.static_keys:
        if "k_static_zero" not in calibration:
            raise ValueError(f"static_keys=True needs a calibration file with static key ranges (layer "
                             f"{layer_idx} has none); allowed without one: static_keys=False")
        k_consts["static_zero"], k_consts["static_scale"] = (calibration["k_static_zero"],
                                                             calibration["k_static_scale"])  # [H, D] each
    if cfg.levels == "lloyd-max":  # data-free levels (the value group is known at the first update)
        k_consts["codebook"] = levels_tensor(cfg.k_bits, cfg.k_group_size, cfg.outliers)
    return k_consts, v_consts


def make_layer(cfg: QuantCacheConfig, layer_idx: int, rope: RopeHelper | None, sliding_window: int | None = None,
               calibration: dict[str, torch.Tensor] | None = None, rotation: SharedRotation | None = None) -> QuantLayer:
    """The quantized layer for `cfg`: a `TokenWindowLayer` for a sliding layer whose recipe holds its window only
    (`holds_window_only`: no calibration applies to it), else a `BlockLayer`."""
    if sliding_window is not None and cfg.holds_window_only():
        return TokenWindowLayer(cfg, layer_idx, rope, sliding_window, None, rotation)
    return BlockLayer(cfg, layer_idx, rope, sliding_window, calibration, rotation)


def check_calibration_options(cfg: QuantCacheConfig, calibrated: bool) -> None:
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


def layer_memory(layer) -> CacheMemory:
    """Bytes of one layer: a `QuantLayer`'s store, constants and positions, or a transformers layer kept in full
    precision (native sliding window): its keys/values, and its other tensors (e.g. the window size as a tensor) as
    bookkeeping."""
    if isinstance(layer, QuantLayer):
        rotation = layer._rotation.nbytes() if layer._owns_rotation else 0  # else the cache counts it, once
        k = layer.consts["k"]
        static = [k.get("static_zero"), k.get("static_scale")]
        levels = _nbytes(*(t for t in layer.const_tensors() if all(t is not x for x in static)))
        if not layer.is_initialized:
            return CacheMemory(codebooks=levels, scales=_nbytes(*static), rotation=rotation)
        parts = layer.store.nbytes()
        return CacheMemory(packed=parts["packed"], scales=parts["scales"] + _nbytes(*static),
                           outliers=parts["outliers"], full_precision=parts["full_precision"], codebooks=levels,
                           positions=_nbytes(layer.first), reserved=parts["reserved"], tokens=layer.stored_length(),
                           rotation=rotation)
    other = [t for name, t in vars(layer).items() if isinstance(t, torch.Tensor) and name not in ("keys", "values")]
    if not getattr(layer, "is_initialized", False) or layer.keys is None:
        return CacheMemory(positions=_nbytes(*other))
    return CacheMemory(full_precision=_nbytes(layer.keys, layer.values), positions=_nbytes(*other),
                       tokens=layer.keys.shape[-2] if layer.keys.dim() == 4 else 0)
