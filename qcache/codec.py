"""Codecs: how a key block and a value group are encoded into stored parts and decoded back.

A codec is a small frozen description (bits, group size, scale dtype, outliers, whether levels come from a
codebook or ranges are static). It declares the tensors it stores (`parts`, see qcache/store.py), encodes fp32
states into them (`encode`) and decodes stored entries into fp32 channel planes (`planes`). The eager read, the
compiled read and the fused decode attention all decode through `planes` (qcache/kernels.py), so a new scheme is one
codec, used alike everywhere. Per-layer tensors a codec needs (a calibrated codebook, static key ranges) are passed
beside it as `consts`, so that compiled code specializes on the description, not on each layer's tensors.

    ========== ============================================ ==============================================
    codec      groups                                       stored per group (besides the packed codes)
    ========== ============================================ ==============================================
    KeyCodec   one channel over a block of `group` tokens   scale, zero; `outliers` (offset, value) pairs
               (per-channel keys, KIVI); `static`: one      static: nothing (range per channel in consts)
               calibrated range per channel for all tokens
    ValueCodec one token over `group` consecutive channels  scale, zero; `outliers` (offset, value) pairs
               `norm`: one token over all head_dim channels  one scale (no zero): Gaussian levels
    ========== ============================================ ==============================================

Levels are uniform (`zero + code * scale`) or, with `codebook=True`, the levels of `consts["codebook"]`: calibrated,
or data-free Lloyd-Max levels (qcache/levels.py). With `rotation=True` every token is multiplied by the orthogonal
`consts["rotation"]` [D, D] (qcache/rotation.py) before it is encoded, and `planes` multiplies the decoded tokens by
its transpose (`rotated=True` leaves them rotated, for a caller that un-rotates once later, as the fused decode does
with the attention-weighted sum of values); groups and outliers live in rotated space. Codes are packed in planes
(qcache/quant.py): `planes` returns the channel slices of the packing ([B, H, n, w] each, in channel order) so that
RoPE pairs can be rotated without interleaving.

Example:
    >>> codec = ValueCodec(bits=4, group=32, scale_dtype=torch.float16)
    >>> codec.bits_per_value(head_dim=64)
    5.0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import (
    code_planes, dequantize, nearest_levels, pack, quantize, quantize_grouped, scatter_outliers, select_outliers, unpack, width,
)
from .store import Part

__all__ = ["KeyCodec", "ValueCodec"]

# ValueCodec(norm=True): rounds of (codes for the scale, least-squares scale for the codes), each no worse than the
# last. Measured relative squared error at 2 bits over 1, 2, 3, 4 rounds: Gaussian tokens 0.112, 0.111, 0.111, 0.111;
# tokens with one channel x 15 (rotated: two clusters, not a Gaussian) 0.116, 0.092, 0.083, 0.081.
_NORM_ROUNDS = 4


@dataclass(frozen=True)
class _GroupCodec:
    bits: int
    group: int
    scale_dtype: torch.dtype
    outliers: int = 0
    clip_ratios: tuple[float, ...] = (1.0,)
    codebook: bool = False
    rotation: bool = False
    prefix: str = ""
    axis: str = "token"  # the store axis of the per-token parts (ValueCodec: "residual" for an 8-bit window)

    def _name(self, part: str) -> str:
        return self.prefix + part

    def bits_per_value(self, head_dim: int, fp_bytes: int = 2) -> float:
        """Stored bits per value, from the declared parts: a token's own entries plus its share of its block's."""
        dtype = {2: torch.float16, 4: torch.float32}[fp_bytes]
        share = {"token": 1.0, "residual": 1.0, "block": 1.0 / self.group}
        return sum(p.entry_bytes * share[p.axis] for p in self.parts(head_dim, dtype)) * 8 / head_dim

    def _levels(self, consts: dict) -> torch.Tensor | None:
        if not self.codebook:
            return None
        cb = consts.get("codebook")
        if cb is None or cb.numel() != 2**self.bits:
            raise ValueError(f"codec {self} needs a codebook of {2**self.bits} levels in consts; got "
                             f"{None if cb is None else cb.numel()}")
        return cb

    def rotate(self, x: torch.Tensor, consts: dict) -> torch.Tensor:
        """x [..., D] fp32 in the space the codes are in: x @ R (x itself without `rotation`)."""
        return x @ consts["rotation"] if self.rotation else x

    def unrotate(self, x: torch.Tensor, consts: dict) -> torch.Tensor:
        """Inverse of `rotate`: x @ R^T (R orthogonal)."""
        return x @ consts["rotation"].T if self.rotation else x

    def planes(self, parts: dict, consts: dict, rotated: bool = False) -> list[torch.Tensor]:
        """fp32 decoded entries as channel planes [B, H, n, w] (in channel order); with `rotation`, un-rotated
        unless `rotated` (then still in rotated space)."""
        planes = self._planes(parts, consts)
        if not self.rotation or rotated:
            return planes
        x = self.unrotate(torch.cat(planes, dim=-1), consts)  # [B, H, n, D]
        return list(x.chunk(len(planes), dim=-1)) if x.shape[-1] % len(planes) == 0 else [x]


@dataclass(frozen=True)
class KeyCodec(_GroupCodec):
    """Keys per channel: one scale/zero per channel per block of `group` tokens (or, `static`, one calibrated range
    per channel for every token: no per-block metadata and no full-precision block to wait for).

    Args:
        bits: a width of `qcache.quant.WIDTHS`.
        group: tokens per block (1 for static ranges).
        scale_dtype: dtype of scales and zeros.
        outliers: per group, this many values farthest from the group's median are kept exactly (cache dtype value +
            1-byte offset in the block) and left out of the range.
        clip_ratios: candidate shrinks of each group's range; each group keeps the least squared error.
        codebook: levels from `consts["codebook"]` instead of uniform steps.
        rotation: tokens are multiplied by `consts["rotation"]` before encoding (and back when decoded).
        static: the range of channel c is `consts["static_zero"/"static_scale"][h, c]` for every token.
        prefix: prepended to the part names (a store holds keys and values).

    Example:
        >>> KeyCodec(bits=2, group=64, scale_dtype=torch.float16, outliers=1).bits_per_value(64, fp_bytes=2)
        2.875
    """

    static: bool = False
    prefix: str = "k_"

    def parts(self, head_dim: int, dtype: torch.dtype) -> list[Part]:
        """The tensors this codec stores for `head_dim` channels in a cache of `dtype`."""
        parts = [Part(self._name("codes"), "token", (width(self.bits).packed_bytes(head_dim),), torch.uint8, "packed")]
        if not self.static:
            parts += [Part(self._name("scale"), "block", (head_dim,), self.scale_dtype, "scales"),
                      Part(self._name("zero"), "block", (head_dim,), self.scale_dtype, "scales")]
        if self.outliers:
            parts += [Part(self._name("out_idx"), "block", (self.outliers, head_dim), torch.uint8, "outliers"),
                      Part(self._name("out_val"), "block", (self.outliers, head_dim), dtype, "outliers")]
        return parts

    def encode(self, k: torch.Tensor, consts: dict, valid: torch.Tensor | None = None,
               fit=None) -> dict[str, torch.Tensor]:
        """Parts for pre-RoPE keys k [B, H, n, D] (n a multiple of `group`); `valid` [B, 1, n, 1] bool keeps padding
        out of the ranges. Returns {part name: tensor} as `parts` declares them. `fit`: another encoder of the
        rotated keys, (codec, k, consts, valid) -> parts, or None where it does not code this codec
        (`native.encode_keys`, qcache's C encoder: the same parts)."""
        out = {}
        keep = valid
        k = self.rotate(k, consts)
        if fit is not None:
            parts = fit(self, k, consts, valid)
            if parts is not None:
                return parts
        if self.outliers:
            idx, val, keep = select_outliers(k, self.outliers, self.group, dim=2, mask=valid)
            out[self._name("out_idx")], out[self._name("out_val")] = idx, val  # [B, H, n/G, m, D]
        if self.static:
            zero = consts["static_zero"].to(k.device)[None, :, None, :]  # [H, D] -> [1, H, 1, D]
            scale = consts["static_scale"].to(k.device)[None, :, None, :]
            codes = quantize(k, scale, zero, self.bits, self._levels(consts))
        else:
            codes, scale, zero = quantize_grouped(k, self.bits, self.group, dim=2, mask=keep,
                                                  scale_dtype=self.scale_dtype, codebook=self._levels(consts),
                                                  clip_ratios=self.clip_ratios)
            out[self._name("scale")], out[self._name("zero")] = scale, zero  # [B, H, n/G, D]
        out[self._name("codes")] = pack(codes, self.bits)
        return out

    def _planes(self, parts: dict, consts: dict) -> list[torch.Tensor]:
        """fp32 pre-RoPE keys of the stored entries as channel planes [B, H, n, w] (in channel order; rotated space
        with `rotation`)."""
        codebook = self._levels(consts)
        planes, a = [], 0
        for codes in code_planes(parts[self._name("codes")], self.bits):
            B, H, n, w = codes.shape
            sl = slice(a, a + w)
            a += w
            if self.static:
                zero = consts["static_zero"][None, :, None, sl]  # [H, D] -> [1, H, 1, w]
                scale = consts["static_scale"][None, :, None, sl]
                planes.append(dequantize(codes, scale, zero, codebook=codebook))
                continue
            G = self.group
            # [B, H, n, w] -> [B, H, n/G, G, w]: one scale/zero per block broadcast over its tokens
            x = dequantize(codes.view(B, H, n // G, G, w), parts[self._name("scale")][..., sl].unsqueeze(3),
                           parts[self._name("zero")][..., sl].unsqueeze(3), codebook=codebook)
            if self.outliers:
                scatter_outliers(x, 3, parts[self._name("out_idx")][..., sl], parts[self._name("out_val")][..., sl])
            planes.append(x.view(B, H, n, w))  # [B, H, n/G, G, w] -> [B, H, n, w]
        return planes


@dataclass(frozen=True)
class ValueCodec(_GroupCodec):
    """Values per token: one scale/zero per token per group of `group` consecutive channels.

    Args: as `KeyCodec` (without `static`); `group` counts channels. With `norm` (`v_scale="norm"`) a group is a
    whole rotated head: its codes index the Gaussian levels of `consts["codebook"]` (in units of σ, symmetric:
    `levels.gaussian_levels`) and one scale per token, no zero-point: starting from the token's RMS, the nearest
    levels for the scale and the least-squares scale for those levels (`<x, l> / <l, l>`) alternate a few rounds.

    Example:
        >>> ValueCodec(bits=4, group=64, scale_dtype=torch.float16).bits_per_value(64)
        4.5
    """

    prefix: str = "v_"
    norm: bool = False

    def __post_init__(self) -> None:
        if self.norm and (self.outliers or self.clip_ratios != (1.0,) or not self.codebook or not self.rotation):
            raise ValueError(f"ValueCodec(norm=True) needs codebook=True and rotation=True, and takes no outliers or "
                             f"clip ratios; got {self}")

    def parts(self, head_dim: int, dtype: torch.dtype) -> list[Part]:
        ng = head_dim // self.group
        ax = self.axis
        if self.norm:
            if self.group != head_dim:
                raise ValueError(f"ValueCodec(norm=True) scales whole heads: group must equal head_dim={head_dim}, "
                                 f"got {self.group}")
            return [Part(self._name("codes"), ax, (width(self.bits).packed_bytes(head_dim),), torch.uint8, "packed"),
                    Part(self._name("scale"), ax, (1,), self.scale_dtype, "scales")]
        parts = [Part(self._name("codes"), ax, (width(self.bits).packed_bytes(head_dim),), torch.uint8, "packed"),
                 Part(self._name("scale"), ax, (ng,), self.scale_dtype, "scales"),
                 Part(self._name("zero"), ax, (ng,), self.scale_dtype, "scales")]
        if self.outliers:
            parts += [Part(self._name("out_idx"), ax, (ng, self.outliers), torch.uint8, "outliers"),
                      Part(self._name("out_val"), ax, (ng, self.outliers), dtype, "outliers")]
        return parts

    def encode(self, v: torch.Tensor, consts: dict, valid: torch.Tensor | None = None,
               nearest=nearest_levels, fit=None) -> dict[str, torch.Tensor]:
        """Parts for values v [B, H, n, D]. (`valid` is accepted for symmetry: padding tokens are groups of their
        own, so they never widen a real token's range.) `nearest`: how `norm` finds each entry's nearest level
        (`quant.nearest_levels`, or a compiled `nearest_levels_unrolled`: the same codes); `fit`: another encoder
        of the rotated tokens, (codec, v, consts) -> parts, or None where it does not code this codec
        (`native.encode_tokens`, qcache's C encoder)."""
        out = {}
        keep = None
        v = self.rotate(v, consts)
        if fit is not None:
            parts = fit(self, v, consts)
            if parts is not None:
                return parts
        if self.norm:
            levels = self._levels(consts).float().to(v.device)
            tiny = torch.finfo(torch.float32).tiny
            scale = v.square().mean(-1, keepdim=True).sqrt()  # start from the RMS, [B, H, n, 1]
            for _ in range(_NORM_ROUNDS):  # alternate: nearest levels for the scale, least-squares scale for them
                codes, lv = nearest(v / scale.clamp_min(tiny), levels)  # [B, H, n, D]
                scale = (v * lv).sum(-1, keepdim=True) / lv.square().sum(-1, keepdim=True)
            out[self._name("codes")] = pack(codes.to(torch.uint8), self.bits)
            out[self._name("scale")] = scale.to(self.scale_dtype)
            return out
        if self.outliers:
            idx, val, keep = select_outliers(v, self.outliers, self.group, dim=3)
            out[self._name("out_idx")], out[self._name("out_val")] = idx, val  # [B, H, n, D/g, m]
        codes, scale, zero = quantize_grouped(v, self.bits, self.group, dim=3, mask=keep,
                                              scale_dtype=self.scale_dtype, codebook=self._levels(consts),
                                              clip_ratios=self.clip_ratios)
        out[self._name("codes")], out[self._name("scale")], out[self._name("zero")] = pack(codes, self.bits), scale, zero
        return out

    def _planes(self, parts: dict, consts: dict) -> list[torch.Tensor]:
        """fp32 values of the stored entries as channel planes [B, H, n, w] (in channel order; rotated space with
        `rotation`)."""
        codebook = self._levels(consts)
        if self.norm:
            levels, scale = codebook.float(), parts[self._name("scale")].float()  # [B, H, n, 1]
            return [levels[codes.long()] * scale for codes in code_planes(parts[self._name("codes")], self.bits)]
        vq, scale, zero = parts[self._name("codes")], parts[self._name("scale")], parts[self._name("zero")]
        out_idx, out_val = (parts[self._name("out_idx")], parts[self._name("out_val")]) if self.outliers else (None,
                                                                                                                None)
        group = self.group
        planes = code_planes(vq, self.bits)
        w = planes[0].shape[-1]
        if w % group and group % w:  # planes and groups do not nest (e.g. D=48, group 16): one plane of all channels
            planes = [unpack(vq, self.bits)]
            w = planes[0].shape[-1]
        out = []
        for i, codes in enumerate(planes):
            B, H, n, _ = codes.shape
            a = i * w
            if w % group == 0:  # the plane holds whole groups
                g = slice(a // group, (a + w) // group)
                # [B, H, n, w] -> [B, H, n, w/group, group]: one scale/zero per group
                x = dequantize(codes.view(B, H, n, w // group, group), scale[..., g].unsqueeze(-1),
                               zero[..., g].unsqueeze(-1), codebook=codebook)
                if out_idx is not None:
                    scatter_outliers(x, 4, out_idx[..., g, :], out_val[..., g, :])
                out.append(x.view(B, H, n, w))  # [B, H, n, w/group, group] -> [B, H, n, w]
                continue
            g = a // group  # the plane lies inside group g, at channel offset a % group
            x = dequantize(codes, scale[..., g:g + 1], zero[..., g:g + 1], codebook=codebook)
            if out_idx is not None:
                # the group's outliers that fall in this plane; the others go to a scratch column that is dropped
                rel = out_idx[..., g, :].long() - a % group  # [B, H, n, m]
                rel = torch.where((rel >= 0) & (rel < w), rel, w)
                x = torch.cat([x, x.new_zeros(B, H, n, 1)], dim=-1).scatter(-1, rel, out_val[..., g, :].to(x.dtype))
                x = x[..., :w]
            out.append(x)
        return out
