"""Fused read of a QuantLayer for `kernel="compiled"`: unpack -> dequantize -> RoPE -> cast -> concatenate in one
`torch.compile`d function per tensor, so the codes are read once and the full-precision keys are written once.

The functions do the eager path's arithmetic (fp32, one rounding to the cache dtype at the end; a fused multiply-add
may change the last fp32 bit). They cover the common layout: every key block full, positions the same consecutive
run in every row, per-block key scales, with or without outliers. `QuantLayer` reads any other layout (a crop that
cut a block, left padding, beams at different positions, static key ranges) with its eager code.
"""

from __future__ import annotations

import torch

from .quant import unpack

__all__ = ["read_keys", "read_values", "compiled"]


def _levels(codes: torch.Tensor, codebook: torch.Tensor | None) -> torch.Tensor:
    if codebook is None:
        return codes.float()
    return (codebook.float() * (codebook.numel() - 1))[codes.long()]


def read_keys(sink: torch.Tensor, kq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              cos: torch.Tensor | None, sin: torch.Tensor | None, res: torch.Tensor, bits: int, group: int,
              codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
              out_val: torch.Tensor | None = None) -> torch.Tensor:
    """[sink | dequantized, re-rotated keys | residual] along the token axis.

    kq [B, H, Tq, D*bits/8] codes; scale/zero [B, H, Tq/group, D]; cos/sin [1, Tq, R] fp32 (None: no RoPE);
    out_idx/out_val [B, H, Tq/group, m, D]: outliers (offsets in their block, values), or None."""
    codes = unpack(kq, bits)
    B, H, Tq, D = codes.shape
    nb = Tq // group
    k = torch.addcmul(zero.float().unsqueeze(3), _levels(codes, codebook).view(B, H, nb, group, D),
                      scale.float().unsqueeze(3))
    if out_idx is not None:
        k = k.scatter(3, out_idx.long(), out_val.float())
    k = k.view(B, H, Tq, D)
    if cos is not None:
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # [1, 1, Tq, R]
        r = c.shape[-1]
        h = r // 2
        x1, x2 = k[..., :h], k[..., h:r]
        parts = [x1 * c[..., :h] - x2 * s[..., :h], x2 * c[..., h:] + x1 * s[..., h:]]
        if r < D:
            parts.append(k[..., r:])
        k = torch.cat(parts, dim=-1)
    return torch.cat([sink, k.to(sink.dtype), res], dim=2)


def read_values(sink: torch.Tensor, vq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, res: torch.Tensor,
                bits: int, group: int, codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
                out_val: torch.Tensor | None = None) -> torch.Tensor:
    """[sink | dequantized values | residual]; scale/zero [B, H, Tq, D/group]; outliers [B, H, Tq, D/group, m]."""
    codes = unpack(vq, bits)
    B, H, Tq, D = codes.shape
    v = torch.addcmul(zero.float().unsqueeze(-1), _levels(codes, codebook).view(B, H, Tq, D // group, group),
                      scale.float().unsqueeze(-1))
    if out_idx is not None:
        v = v.scatter(4, out_idx.long(), out_val.float())
    v = v.view(B, H, Tq, D)
    return torch.cat([sink, v.to(sink.dtype), res], dim=2)


_COMPILED: dict[str, object] = {}


def compiled(name: str):
    """The torch.compile'd `read_keys` / `read_values` (built on first use, dynamic shapes: the token count grows
    every step). Raises if torch.compile cannot build it here (e.g. no C++ compiler for the CPU backend)."""
    fn = _COMPILED.get(name)
    if fn is None:
        fn = torch.compile({"read_keys": read_keys, "read_values": read_values}[name], dynamic=True)
        _COMPILED[name] = fn
    return fn
