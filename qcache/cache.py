"""QuantCache: a transformers `Cache` that stores keys pre-RoPE per channel and values per token, bit-packed.

Layout of one layer (B = batch, H = kv heads, D = head_dim, G = k_group_size, tokens in cache order):

    ========== ======================================= ============================================
    region     keys                                    values
    ========== ======================================= ============================================
    sinks      first `sink_tokens` tokens, as given (post-RoPE), full precision
    quantized  pre-RoPE codes [B, H, Tq, D*kb/8] uint8  codes [B, H, Tq, D*vb/8] uint8
               scale/zero per channel per block of G     scale/zero per token per `v_group_size`
               tokens: [B, H, n_blocks, D]               channels: [B, H, Tq, D / v_group_size]
    residual   the block being filled + `recent_tokens`, as given (post-RoPE), full precision
    ========== ======================================= ============================================

Positions are kept per token ([B, T] int32, -1 for left padding) to re-apply RoPE and to keep padding out of the
key statistics. Tokens move from the residual to the quantized region G at a time, once, and are never
re-quantized. `update()` returns what the cache holds: dequantized keys (RoPE re-applied) and values for the
quantized region, the stored full-precision tokens elsewhere.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from .config import CLIP_RATIOS, QuantCacheConfig
from .calibfile import CalibrationData, load_calibration
from . import kernels
from .quant import dequantize, pack, quantize, quantize_grouped, select_outliers, unpack
from .attention import ATTN_IMPLEMENTATION as FUSED_ATTENTION  # the attention that can read codes itself
from .rope import RopeHelper, apply_rope_into, modeling_module_of

__all__ = ["QuantCache", "QuantLayer", "CacheMemory", "model_fingerprint"]

logger = logging.getLogger(__name__)

_SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class CacheMemory:
    """Bytes a cache holds, counted from its tensors."""

    packed: int = 0  # bit-packed codes
    scales: int = 0  # scales and zero-points
    full_precision: int = 0  # sinks, the block being filled, the recent window, native sliding layers
    positions: int = 0  # int32 positions per token
    tokens: int = 0  # tokens held by the longest layer
    outliers: int = 0  # dense-and-sparse outliers: values and their 1-byte offsets

    @property
    def total(self) -> int:
        return self.packed + self.scales + self.full_precision + self.positions + self.outliers

    def __add__(self, other: "CacheMemory") -> "CacheMemory":
        return CacheMemory(
            self.packed + other.packed, self.scales + other.scales, self.full_precision + other.full_precision,
            self.positions + other.positions, max(self.tokens, other.tokens), self.outliers + other.outliers,
        )


def model_fingerprint(text_config) -> dict:
    """What identifies a model for the cache: geometry, layer types and RoPE."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    layer_types = getattr(text_config, "layer_types", None)
    rope = getattr(text_config, "rope_parameters", None)
    return {
        "model_type": text_config.model_type,
        "num_hidden_layers": int(text_config.num_hidden_layers),
        "num_key_value_heads": int(getattr(text_config, "num_key_value_heads", None)
                                   or text_config.num_attention_heads),
        "head_dim": int(head_dim),
        "layer_types": list(layer_types) if layer_types is not None else None,
        "sliding_window": getattr(text_config, "sliding_window", None),
        "rope_parameters": json.loads(json.dumps(rope, sort_keys=True, default=str)) if rope is not None else None,
    }


def _positions_from_kwargs(kwargs: dict) -> torch.Tensor | None:
    inner = kwargs.get("kwargs")
    if isinstance(inner, dict) and inner.get("position_ids") is not None:
        return inner["position_ids"]
    return kwargs.get("position_ids")


def _mark_padding(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] positions -> int32 positions with left padding set to -1.

    Real tokens form a run of consecutive positions that ends the chunk; a token whose position in that run would
    be negative is padding (transformers gives pads position 0 or 1)."""
    T = position_ids.shape[-1]
    expected = position_ids[:, -1:] - torch.arange(T - 1, -1, -1, device=position_ids.device)  # [B, T]
    return torch.where(expected < 0, -1, position_ids).to(torch.int32)


def _extend_run(start: int | None, held: int, new: torch.Tensor) -> int | None:
    """The first position of the run `q_pos` forms once positions `new` [B, n] follow `held` tokens starting at
    `start`; None when the rows differ or the run breaks (left padding, beams at different positions)."""
    if new.shape[1] == 0:
        return start
    if held and start is None:
        return None
    first = int(new[0, 0])
    run = first + torch.arange(new.shape[1], device=new.device, dtype=new.dtype)
    if not bool((new == run).all()) or (held and first != start + held):
        return None
    return first if not held else start


class QuantLayer(CacheLayerMixin):
    """One layer of `QuantCache` (see the module docstring for the layout)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cfg: QuantCacheConfig, layer_idx: int, rope: RopeHelper | None,
                 sliding_window: int | None = None, calibration: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.cfg = cfg
        calibration = calibration or {}
        self.k_codebook = calibration.get("k_codebook") if cfg.codebooks else None
        self.v_codebook = calibration.get("v_codebook") if cfg.codebooks else None
        for name, cb, bits in (("k_codebook", self.k_codebook, cfg.k_bits), ("v_codebook", self.v_codebook, cfg.v_bits)):
            if cb is not None and cb.numel() != 2**bits:
                raise ValueError(f"layer {layer_idx}: calibrated {name} has {cb.numel()} levels but {bits} bits "
                                 f"need {2**bits}; calibrate for these bits or pass codebooks=False")
        self.k_static = None
        if cfg.static_keys:
            if "k_static_zero" not in calibration:
                raise ValueError(f"static_keys=True needs a calibration file with static key ranges (layer "
                                 f"{layer_idx} has none); allowed without one: static_keys=False")
            self.k_static = (calibration["k_static_zero"], calibration["k_static_scale"])  # [H, D] each
        self.layer_idx = layer_idx
        self.rope = rope
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.sink_tokens = 0 if self.is_sliding else cfg.sink_tokens
        self.scale_dtype = _SCALE_DTYPES[cfg.scale_dtype]
        self.clip_ratios = CLIP_RATIOS if cfg.clip_search else (1.0,)
        # set by QuantCache each forward: the attention is qcache_fp32, which can attend from the codes directly
        self.fused_attention = False
        self._clear()

    # -- state -----------------------------------------------------------------------------------------------
    def _clear(self) -> None:
        self.is_initialized = False
        self.keys = self.values = None  # unused: kept for transformers code that peeks at them
        self.sink_k = self.sink_v = self.sink_pos = None
        self.kq = self.k_scale = self.k_zero = None
        self.vq = self.v_scale = self.v_zero = None
        self.q_pos = None
        # outliers (cfg.outliers > 0): offsets (uint8) and values (cache dtype) per key channel per block
        # [B, H, n_blocks, m, D] and per value group per token [B, H, Tq, D / v_group_size, m]
        self.k_oi = self.k_ov = self.v_oi = self.v_ov = None
        self.block_lens: list[int] = []
        # read fast paths, kept up to date where the quantized region changes (not recomputed per step):
        self._uniform_blocks = True  # every key block holds k_group_size tokens
        self._q_start: int | None = None  # q_pos is start, start+1, ... in every row (else None)
        self.res_k = self.res_v = self.res_pos = None
        self.cumulative_length = 0  # tokens ever seen (what sliding masks count)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape  # key_states: [B, H, T, D]
        self.v_group = self.cfg.value_group_size(D)
        self.dtype, self.device = key_states.dtype, key_states.device
        dev = self.device

        def empty(*shape, dtype=self.dtype):
            return torch.empty(*shape, dtype=dtype, device=dev)

        self.sink_k, self.sink_v = empty(B, H, 0, D), empty(B, H, 0, D)
        self.sink_pos = empty(B, 0, dtype=torch.int32)
        self.kq = empty(B, H, 0, D * self.cfg.k_bits // 8, dtype=torch.uint8)
        self.vq = empty(B, H, 0, D * self.cfg.v_bits // 8, dtype=torch.uint8)
        self.k_scale = empty(B, H, 0, D, dtype=self.scale_dtype)
        self.k_zero = empty(B, H, 0, D, dtype=self.scale_dtype)
        ng = D // self.v_group
        self.v_scale = empty(B, H, 0, ng, dtype=self.scale_dtype)
        self.v_zero = empty(B, H, 0, ng, dtype=self.scale_dtype)
        self.q_pos = empty(B, 0, dtype=torch.int32)
        m = self.cfg.outliers
        if m:
            self.k_oi, self.k_ov = empty(B, H, 0, m, D, dtype=torch.uint8), empty(B, H, 0, m, D)
            self.v_oi, self.v_ov = empty(B, H, 0, ng, m, dtype=torch.uint8), empty(B, H, 0, ng, m)
        self.res_k, self.res_v = empty(B, H, 0, D), empty(B, H, 0, D)
        self.res_pos = empty(B, 0, dtype=torch.int32)
        self.is_initialized = True

    def _batch_tensors(self) -> list[str]:
        names = ["sink_k", "sink_v", "sink_pos", "kq", "k_scale", "k_zero", "vq", "v_scale", "v_zero", "q_pos",
                 "res_k", "res_v", "res_pos"]
        return names + (["k_oi", "k_ov", "v_oi", "v_ov"] if self.cfg.outliers else [])

    @property
    def quantized_length(self) -> int:
        return 0 if not self.is_initialized else self.kq.shape[2]

    def stored_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sink_k.shape[2] + self.kq.shape[2] + self.res_k.shape[2]

    # -- update ----------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new states and return all keys/values as the cache now holds them ([B, H, T_total, D])."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.sink_k.shape[0] or key_states.shape[-1] != self.sink_k.shape[-1]:
            raise ValueError(
                f"layer {self.layer_idx} holds batch {self.sink_k.shape[0]} x head_dim {self.sink_k.shape[-1]} but "
                f"got key_states of shape {tuple(key_states.shape)}; call reset() before reusing the cache"
            )
        B, _, T, _ = key_states.shape  # key_states: [B, H, T, D]
        position_ids = _positions_from_kwargs(kwargs)
        if position_ids is None:
            if self.rope is not None:
                raise ValueError(
                    "QuantCache(rope='pre') needs the position_ids that attention passes to Cache.update, and got "
                    "none; pass position_ids to the model or use rope='post'"
                )
            position_ids = torch.arange(self.cumulative_length, self.cumulative_length + T, device=self.device)
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [batch, seq]; got shape {tuple(position_ids.shape)}")
        pos = _mark_padding(position_ids.to(self.device).expand(B, T))  # [B, T] int32
        kv_before = self.get_mask_sizes(T)[0] - T if self.is_sliding else None
        self.cumulative_length += T

        key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        n_sink = min(self.sink_tokens - self.sink_k.shape[2], T) if self.kq.shape[2] + self.res_k.shape[2] == 0 else 0
        n_sink = max(n_sink, 0)
        if n_sink:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :n_sink]], dim=2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :n_sink]], dim=2)
            self.sink_pos = torch.cat([self.sink_pos, pos[:, :n_sink]], dim=1)
        self.res_k = torch.cat([self.res_k, key_states[:, :, n_sink:]], dim=2)
        self.res_v = torch.cat([self.res_v, value_states[:, :, n_sink:]], dim=2)
        self.res_pos = torch.cat([self.res_pos, pos[:, n_sink:]], dim=1)
        self._flush()

        if T == 1 and self.fused_attention and self._decode_fusable():
            return self._lazy_states()
        keys, values = self.read()
        if self.is_sliding:
            keys, values = keys[:, :, -(kv_before + T):], values[:, :, -(kv_before + T):]
            self._evict()
        return keys, values

    def _flush(self) -> None:
        """Quantize whole blocks of G tokens out of the residual, keeping `recent_tokens` in full precision."""
        G = 1 if self.k_static is not None else self.cfg.k_group_size
        n = (self.res_k.shape[2] - self.cfg.recent_tokens) // G * G
        if n <= 0:
            return
        k, v, p = self.res_k[:, :, :n], self.res_v[:, :, :n], self.res_pos[:, :n]  # [B, H, n, D], [B, n]
        valid = (p >= 0)[:, None, :, None]  # [B, 1, n, 1]: padding stays out of the statistics
        if self.rope is not None:
            k = self.rope.undo(k, p, self.layer_idx)  # fp32, pre-RoPE
        v_keep = None
        if self.cfg.outliers:  # dense-and-sparse: the farthest values of each group are kept, out of its range
            m = self.cfg.outliers
            k_oi, k_ov, valid = select_outliers(k, m, G, dim=2, mask=valid)
            v_oi, v_ov, v_keep = select_outliers(v, m, self.v_group, dim=3)
            self.k_oi, self.k_ov = torch.cat([self.k_oi, k_oi], 2), torch.cat([self.k_ov, k_ov.to(self.dtype)], 2)
            self.v_oi, self.v_ov = torch.cat([self.v_oi, v_oi], 2), torch.cat([self.v_ov, v_ov.to(self.dtype)], 2)
        if self.k_static is not None:
            zero, scale = self._static_key_range(k.device)
            k_codes = quantize(k, scale, zero, self.cfg.k_bits, self.k_codebook)
            k_scale = k_zero = self.k_scale[:, :, :0]  # no per-block key scales
        else:
            k_codes, k_scale, k_zero = quantize_grouped(k, self.cfg.k_bits, G, dim=2, mask=valid,
                                                        scale_dtype=self.scale_dtype, codebook=self.k_codebook,
                                                        clip_ratios=self.clip_ratios)
        v_codes, v_scale, v_zero = quantize_grouped(v, self.cfg.v_bits, self.v_group, dim=3, mask=v_keep,
                                                    scale_dtype=self.scale_dtype, codebook=self.v_codebook,
                                                    clip_ratios=self.clip_ratios)
        self.kq = torch.cat([self.kq, pack(k_codes, self.cfg.k_bits)], dim=2)
        self.vq = torch.cat([self.vq, pack(v_codes, self.cfg.v_bits)], dim=2)
        self.k_scale = torch.cat([self.k_scale, k_scale], dim=2)
        self.k_zero = torch.cat([self.k_zero, k_zero], dim=2)
        self.v_scale = torch.cat([self.v_scale, v_scale], dim=2)
        self.v_zero = torch.cat([self.v_zero, v_zero], dim=2)
        self._q_start = _extend_run(self._q_start, self.q_pos.shape[1], p)
        self.q_pos = torch.cat([self.q_pos, p], dim=1)
        if self.k_static is None:
            self.block_lens.extend([G] * (n // G))
        self.res_k, self.res_v, self.res_pos = (
            self.res_k[:, :, n:].clone(), self.res_v[:, :, n:].clone(), self.res_pos[:, n:].clone())

    def _evict(self) -> None:
        """Sliding layers: drop whole quantized blocks that no future query can see."""
        keep = self.sliding_window - 1
        if self.k_static is not None:  # token-granular: drop the oldest quantized tokens
            drop = min(max(self.stored_length() - keep, 0), self.kq.shape[2])
            for name in self._per_token_names():
                setattr(self, name, getattr(self, name)[:, :, drop:])
            self.q_pos = self.q_pos[:, drop:]
            self._q_start = None if self._q_start is None else self._q_start + drop
        while self.block_lens and self.stored_length() - self.block_lens[0] >= keep:
            n = self.block_lens.pop(0)
            for name in self._per_token_names():
                setattr(self, name, getattr(self, name)[:, :, n:])
            for name in self._per_block_names():
                setattr(self, name, getattr(self, name)[:, :, 1:])
            self.q_pos = self.q_pos[:, n:]
            self._q_start = None if self._q_start is None else self._q_start + n
            self._blocks_changed()
        surplus = self.stored_length() - keep
        if self.kq.shape[2] == 0 and surplus > 0:  # only full-precision tokens left: trim them exactly
            self.res_k, self.res_v = self.res_k[:, :, surplus:], self.res_v[:, :, surplus:]
            self.res_pos = self.res_pos[:, surplus:]

    def _blocks_changed(self) -> None:
        """block_lens changed other than by appending full blocks: recompute the read fast-path flag."""
        self._uniform_blocks = all(b == self.cfg.k_group_size for b in self.block_lens)

    def _per_token_names(self) -> list[str]:
        """Tensors of the quantized region with one entry per token on dim 2."""
        return ["kq", "vq", "v_scale", "v_zero"] + (["v_oi", "v_ov"] if self.cfg.outliers else [])

    def _per_block_names(self) -> list[str]:
        """Tensors with one entry per key block on dim 2."""
        return ["k_scale", "k_zero"] + (["k_oi", "k_ov"] if self.cfg.outliers else [])

    def _static_key_range(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Calibrated static key zero/scale, [H, D] -> [1, H, 1, D] on `device`."""
        return tuple(t.to(device)[None, :, None, :] for t in self.k_static)

    # -- reading ---------------------------------------------------------------------------------------------
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (RoPE applied) and values as the cache holds them, in the cache dtype: [sinks | dequantized |
        residual], [B, H, T_stored, D]."""
        S, Tq, R = self.sink_k.shape[2], self.kq.shape[2], self.res_k.shape[2]
        if Tq == 0:
            return torch.cat([self.sink_k, self.res_k], dim=2), torch.cat([self.sink_v, self.res_v], dim=2)
        if self.cfg.kernel == "compiled" and self._fused_layout():
            cos, sin = self._quantized_cos_sin()
            keys = kernels.compiled("read_keys", self._kernel_variant)(
                self.sink_k, self.kq, self.k_scale, self.k_zero, cos, sin, self.res_k, self.cfg.k_bits,
                self.cfg.k_group_size, self.k_codebook, self.k_oi, self.k_ov)
            values = kernels.compiled("read_values", self._kernel_variant)(
                self.sink_v, self.vq, self.v_scale, self.v_zero, self.res_v, self.cfg.v_bits, self.v_group,
                self.v_codebook, self.v_oi, self.v_ov)
            return keys, values
        B, H, _, D = self.res_k.shape
        keys = self.res_k.new_empty(B, H, S + Tq + R, D)
        values = self.res_v.new_empty(B, H, S + Tq + R, D)
        keys[:, :, :S], keys[:, :, S + Tq:] = self.sink_k, self.res_k
        values[:, :, :S], values[:, :, S + Tq:] = self.sink_v, self.res_v
        self._dequantize_keys_into(keys[:, :, S:S + Tq])
        self._dequantize_values_into(values[:, :, S:S + Tq])
        return keys, values

    @property
    def _kernel_variant(self) -> tuple:
        """What makes the compiled functions' code differ between caches (each gets its own compile budget)."""
        return (self.cfg.k_bits, self.cfg.v_bits, self.cfg.k_group_size, self.v_group, self.cfg.outliers,
                self.k_codebook is not None, self.v_codebook is not None, self.rope is not None, self.dtype)

    def _quantized_cos_sin(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """fp32 cos/sin of the quantized region's positions ([1, Tq, R], a table view, when they are one run in
        every row; else [B, Tq, R]); (None, None) without RoPE."""
        if self.rope is None:
            return None, None
        if self._q_start is not None:
            return self.rope.cos_sin_range(self._q_start, self.kq.shape[2], self.layer_idx, self.kq.device)
        return self.rope.cos_sin(self.q_pos, self.layer_idx)

    def _fused_layout(self) -> bool:
        """The layout `kernels` handles: full key blocks with per-block scales, one position run for all rows."""
        return self.k_static is None and self._uniform_blocks and (self.rope is None or self._q_start is not None)

    # -- fused decode attention (kernel="compiled" with the qcache_fp32 attention) --------------------------------
    def _decode_fusable(self) -> bool:
        return (self.cfg.kernel == "compiled" and not self.is_sliding and self.kq.shape[2] > 0
                and self._fused_layout())

    def _lazy_states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What `update` returns when attention will read the codes itself: the full-precision tokens
        [sinks | residual], tagged with this layer (`_qcache_layer`). Only qcache_fp32 attention receives them; it
        attends over sinks, quantized region and residual with `decode_attention`, or calls `read()`."""
        keys = torch.cat([self.sink_k, self.res_k], dim=2)
        values = torch.cat([self.sink_v, self.res_v], dim=2)
        keys._qcache_layer = values._qcache_layer = self
        return keys, values

    def decode_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None,
                         fp_states: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """fp32 attention of one query token [B, Hq, 1, D] over everything held, straight from the codes
        (`kernels.decode_attention`); attention_mask: None, bool (True = attend) or additive, [B, 1, 1, T_held];
        fp_states: what `update` returned ([sinks | residual] keys and values). Returns [B, Hq, 1, D] fp32."""
        B, Hq, _, D = query.shape
        H = self.kq.shape[1]
        S, Tq, R = self.sink_k.shape[2], self.kq.shape[2], self.res_k.shape[2]
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
        cos, sin = self._quantized_cos_sin()
        q = query.float().reshape(B, H, Hq // H, D)  # query head h*G+g reads kv head h (as repeat_kv)
        out = kernels.compiled("decode_attention", self._kernel_variant)(
            q, fp_k, fp_v, S, self.kq, self.k_scale, self.k_zero, cos, sin, self.vq, self.v_scale, self.v_zero, bias,
            D**-0.5 if scaling is None else scaling, self.cfg.k_bits, self.cfg.k_group_size, self.cfg.v_bits,
            self.v_group, self.k_codebook, self.v_codebook, self.k_oi, self.k_ov, self.v_oi, self.v_ov)
        return out.reshape(B, Hq, 1, D)

    def _per_token(self, per_block: torch.Tensor) -> torch.Tensor:
        """[B, H, n_blocks, D] -> [B, H, Tq, D] following block_lens."""
        lens = torch.tensor(self.block_lens, device=per_block.device)
        return per_block.repeat_interleave(lens, dim=2)

    def _dequantize_keys_into(self, out: torch.Tensor) -> None:
        """Write the quantized region's keys (RoPE re-applied, in the cache dtype) into `out` [B, H, Tq, D]."""
        cos, sin = self._quantized_cos_sin()
        if self._uniform_blocks and self.k_static is None:  # plane by plane (see qcache/kernels.py)
            _write_planes(out, kernels.key_planes(self.kq, self.k_scale, self.k_zero, self.cfg.k_bits,
                                                  self.cfg.k_group_size, self.k_codebook, self.k_oi, self.k_ov,
                                                  cos, sin))
            return
        codes = unpack(self.kq, self.cfg.k_bits)  # [B, H, Tq, D]
        if self.k_static is not None:
            zero, scale = self._static_key_range(codes.device)
            k = dequantize(codes, scale, zero, codebook=self.k_codebook)
        else:  # a crop left a partial block
            k = dequantize(codes, self._per_token(self.k_scale), self._per_token(self.k_zero),
                           codebook=self.k_codebook)
            if self.cfg.outliers:
                k = self._scatter_key_outliers_partial(k)
        if cos is None:
            out.copy_(k)
        else:
            apply_rope_into(out, k, cos, sin)

    def _scatter_key_outliers_partial(self, k: torch.Tensor) -> torch.Tensor:
        """Key outliers into per-token keys [B, H, Tq, D] when blocks differ in length (after a crop): outliers
        whose token was cropped go to a scratch row that is dropped."""
        B, H, Tq, D = k.shape
        lens = torch.tensor(self.block_lens, device=k.device)
        starts = (lens.cumsum(0) - lens)[None, None, :, None, None]  # [1, 1, nb, 1, 1]
        offset = self.k_oi.long()  # [B, H, nb, m, D]
        token = torch.where(offset < lens[None, None, :, None, None], starts + offset, Tq)
        scratch = torch.cat([k, k.new_zeros(B, H, 1, D)], dim=2)
        scratch.scatter_(2, token.flatten(2, 3), self.k_ov.flatten(2, 3).to(k.dtype))
        return scratch[:, :, :Tq]

    def _dequantize_values_into(self, out: torch.Tensor) -> None:
        _write_planes(out, kernels.value_planes(self.vq, self.v_scale, self.v_zero, self.cfg.v_bits, self.v_group,
                                                self.v_codebook, self.v_oi, self.v_ov))

    def _dequantized_keys(self) -> torch.Tensor:
        """The quantized region's keys alone, [B, H, Tq, D] in the cache dtype."""
        out = self.res_k.new_empty(*self.kq.shape[:3], self.res_k.shape[-1])
        if out.shape[2]:
            self._dequantize_keys_into(out)
        return out

    def _dequantized_values(self) -> torch.Tensor:
        out = self.res_v.new_empty(*self.vq.shape[:3], self.res_v.shape[-1])
        if out.shape[2]:
            self._dequantize_values_into(out)
        return out

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
        for name in self._batch_tensors():  # every one is a tensor once initialized
            setattr(self, name, fn(getattr(self, name)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder rows of every stored tensor (codes included: nothing is re-quantized)."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (a negative int, as for `DynamicLayer`). Tokens that stay keep
        the values they were stored with; a block cut in the middle keeps its scales."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as for DynamicLayer"
            )
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if self.is_sliding and self.cumulative_length >= self.sliding_window:
            raise ValueError("cannot crop a quantized sliding-window layer once its window is full")
        n = min(n, self.stored_length())
        self.cumulative_length -= n
        r = min(n, self.res_k.shape[2])
        if r:
            end = self.res_k.shape[2] - r
            self.res_k, self.res_v, self.res_pos = (
                self.res_k[:, :, :end].clone(), self.res_v[:, :, :end].clone(), self.res_pos[:, :end].clone())
            n -= r
        q = min(n, self.kq.shape[2])
        if q:
            end = self.kq.shape[2] - q
            for name in self._per_token_names():
                setattr(self, name, getattr(self, name)[:, :, :end].clone())
            self.q_pos = self.q_pos[:, :end].clone()
            left = q if self.k_static is None else 0
            while left:
                take = min(left, self.block_lens[-1])
                self.block_lens[-1] -= take
                left -= take
                if self.block_lens[-1] == 0:
                    self.block_lens.pop()
            nb = len(self.block_lens)
            for name in self._per_block_names():
                setattr(self, name, getattr(self, name)[:, :, :nb].clone())
            self._blocks_changed()
            n -= q
        if n:
            end = self.sink_k.shape[2] - n
            self.sink_k, self.sink_v = self.sink_k[:, :, :end].clone(), self.sink_v[:, :, :end].clone()
            self.sink_pos = self.sink_pos[:, :end].clone()

    def memory(self) -> CacheMemory:
        if not self.is_initialized:
            return CacheMemory()
        return CacheMemory(
            packed=_nbytes(self.kq, self.vq),
            scales=_nbytes(self.k_scale, self.k_zero, self.v_scale, self.v_zero, self.k_codebook, self.v_codebook,
                           *(self.k_static or ())),
            full_precision=_nbytes(self.sink_k, self.sink_v, self.res_k, self.res_v),
            positions=_nbytes(self.sink_pos, self.q_pos, self.res_pos),
            tokens=self.stored_length(),
            outliers=_nbytes(self.k_oi, self.k_ov, self.v_oi, self.v_ov),
        )


def _write_planes(out: torch.Tensor, planes: list[torch.Tensor]) -> None:
    """Channel planes [..., w] side by side into `out` [..., D] (cast to its dtype)."""
    a = 0
    for p in planes:
        out[..., a:a + p.shape[-1]] = p
        a += p.shape[-1]


def _dynamic_layer_memory(layer) -> CacheMemory:
    if not getattr(layer, "is_initialized", False) or layer.keys is None:
        return CacheMemory()
    return CacheMemory(full_precision=_nbytes(layer.keys, layer.values),
                       tokens=layer.keys.shape[-2] if layer.keys.dim() == 4 else 0)


def _find_attention_module(layer_idx: int, depth: int = 4) -> nn.Module | None:
    """The attention module calling `Cache.update` (found on the call stack): it carries the model's config."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and hasattr(owner, "config") and getattr(owner, "layer_idx", None) == layer_idx:
            return owner
        frame = frame.f_back
    return None


class QuantCache(Cache):
    """A quantized KV cache for `model.generate` and plain forward passes.

    Keys are stored pre-RoPE, quantized per channel over blocks of `k_group_size` tokens; values per token in groups
    of `v_group_size` channels; both bit-packed. Attention reads what the cache holds (dequantized).

    Args:
        config: the model's config. Optional: when omitted, the cache takes it from the attention module that
            first calls `update` (so `QuantCache(bits=4)` works as written in `generate`).
        bits / k_bits / v_bits / ...: any `QuantCacheConfig` field, or `options=QuantCacheConfig(...)`.

    Example:
        >>> cache = QuantCache(bits=4)                                              # doctest: +SKIP
        >>> model.generate(**inputs, past_key_values=cache, max_new_tokens=20)      # doctest: +SKIP
        >>> cache.memory().total                                                    # doctest: +SKIP
    """

    def __init__(self, config=None, *, options: QuantCacheConfig | None = None,
                 calibration: "str | CalibrationData | None" = None, **kwargs):
        if options is not None and kwargs:
            raise ValueError(f"pass either options= or keyword options, not both (got {sorted(kwargs)})")
        if isinstance(calibration, (str, bytes)) or hasattr(calibration, "__fspath__"):
            calibration = load_calibration(calibration)
        self.calibration: CalibrationData | None = calibration
        if options is None:
            given = {k: v for k, v in kwargs.items() if v is not None}
            if calibration is not None:  # the file's options, overridden by what the caller passes
                base = QuantCacheConfig.from_dict(calibration.options).to_dict()
                if "bits" in given:
                    base.pop("k_bits"), base.pop("v_bits")
                given = {**base, **given}
            options = QuantCacheConfig(**given)
        if options.static_keys and calibration is None:
            raise ValueError("static_keys=True needs a calibration file (calibration=path); allowed without one: "
                             "static_keys=False")
        self.options = options
        super().__init__(layers=[])
        self._fingerprint: dict | None = None
        self._config_obj = None
        self._text_config = None
        self._explicit = config is not None
        if config is not None:
            self._bind(config.get_text_config(decoder=True), modeling_module=None, prefix=None)

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
        layers = []
        for idx, layer_type in enumerate(layer_types):
            calib = self.calibration.layer(idx) if self.calibration is not None else None
            if layer_type == "full_attention":
                layers.append(QuantLayer(self.options, idx, rope, calibration=calib))
            elif layer_type == "sliding_attention":
                window = text_config.sliding_window
                if self.options.sliding_layers == "native":
                    layers.append(DynamicSlidingWindowLayer(sliding_window=window))
                else:
                    layers.append(QuantLayer(self.options, idx, rope, sliding_window=window, calibration=calib))
            else:
                raise ValueError(
                    f"layer {idx} of model_type={fingerprint['model_type']!r} has layer type {layer_type!r}; "
                    "QuantCache supports: ['full_attention', 'sliding_attention']"
                )
        self.layers = layers
        self._fingerprint = fingerprint
        self._config_obj = config_obj if config_obj is not None else text_config
        self._text_config = text_config

    def _check_model(self, layer_idx: int) -> None:
        module = _find_attention_module(layer_idx)
        self._check_module(module)
        # decode attention from the codes only when the model's attention is the one that knows how (it is looked
        # up every forward: set_attn_implementation may change it between calls)
        fused = module is not None and getattr(module.config, "_attn_implementation", None) == FUSED_ATTENTION
        for layer in self.layers:
            if isinstance(layer, QuantLayer):
                layer.fused_attention = fused

    def _check_module(self, module: nn.Module | None) -> None:
        if module is None:
            if self._fingerprint is None:
                raise ValueError(
                    "QuantCache needs the model's config for pre-RoPE keys and could not find the calling attention "
                    "module; construct it as QuantCache(model.config, ...)"
                )
            return
        config = module.config
        if config is self._config_obj:
            return
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if self._fingerprint is None or (self.get_seq_length() == 0 and not self._explicit):
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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 or self._fingerprint is None:
            self._check_model(layer_idx)
        if layer_idx >= len(self.layers):
            raise ValueError(f"layer_idx={layer_idx} but the model has {len(self.layers)} layers")
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        if not self._explicit:  # an empty cache may serve another model
            self._config_obj = None

    # -- reporting -------------------------------------------------------------------------------------------
    def memory(self) -> CacheMemory:
        """Bytes held, split into packed codes, scales/zeros, full-precision tokens and positions."""
        total = CacheMemory()
        for layer in self.layers:
            total = total + (layer.memory() if isinstance(layer, QuantLayer) else _dynamic_layer_memory(layer))
        return total

    def __repr__(self) -> str:
        return f"QuantCache({self.options}, layers={len(self.layers)})"
