"""Fused read of a QuantLayer for `kernel="compiled"`: unpack -> dequantize -> RoPE -> cast -> concatenate in one
`torch.compile`d function per tensor, so the codes are read once and the full-precision keys are written once.

The functions do the eager path's arithmetic (fp32, one rounding to the cache dtype at the end; a fused multiply-add
may change the last fp32 bit). They cover the common layout: every key block full, positions the same consecutive
run in every row, per-block key scales, with or without outliers. `QuantLayer` reads any other layout (a crop that
cut a block, left padding, beams at different positions, static key ranges) with its eager code.
"""

from __future__ import annotations

import torch

from .quant import dequantize, scatter_outliers, unpack
from .rope import apply_rope

__all__ = ["block_keys", "group_values", "read_keys", "read_values", "compiled"]


def block_keys(kq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
               codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
               out_val: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 keys [B, H, Tq, D] (before RoPE) from codes kq [B, H, Tq, D*bits/8] in full blocks of `group` tokens,
    scale/zero [B, H, Tq/group, D] per block and channel, outliers [B, H, Tq/group, m, D] (offsets, values) or None."""
    codes = unpack(kq, bits)
    B, H, Tq, D = codes.shape
    # [B, H, Tq, D] -> [B, H, Tq/group, group, D]: one scale/zero per block broadcast over its tokens
    k = dequantize(codes.view(B, H, Tq // group, group, D), scale.unsqueeze(3), zero.unsqueeze(3), codebook=codebook)
    if out_idx is not None:
        scatter_outliers(k, 3, out_idx, out_val)
    return k.view(B, H, Tq, D)


def group_values(vq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
                 codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
                 out_val: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values [B, H, Tq, D] from codes with scale/zero [B, H, Tq, D/group] per token and channel group,
    outliers [B, H, Tq, D/group, m] (offsets, values) or None."""
    codes = unpack(vq, bits)
    B, H, Tq, D = codes.shape
    # [B, H, Tq, D] -> [B, H, Tq, D/group, group] to broadcast one scale per group
    v = dequantize(codes.view(B, H, Tq, D // group, group), scale.unsqueeze(-1), zero.unsqueeze(-1),
                   codebook=codebook)
    if out_idx is not None:
        scatter_outliers(v, 4, out_idx, out_val)
    return v.view(B, H, Tq, D)


def read_keys(sink: torch.Tensor, kq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              cos: torch.Tensor | None, sin: torch.Tensor | None, res: torch.Tensor, bits: int, group: int,
              codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
              out_val: torch.Tensor | None = None) -> torch.Tensor:
    """[sink | dequantized, re-rotated keys | residual] along the token axis; cos/sin [1, Tq, R] fp32 (None: no
    RoPE); the rest as for `block_keys`."""
    k = block_keys(kq, scale, zero, bits, group, codebook, out_idx, out_val)
    if cos is not None:
        k = apply_rope(k, cos, sin)
    return torch.cat([sink, k.to(sink.dtype), res], dim=2)


def read_values(sink: torch.Tensor, vq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, res: torch.Tensor,
                bits: int, group: int, codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
                out_val: torch.Tensor | None = None) -> torch.Tensor:
    """[sink | dequantized values | residual]; the rest as for `group_values`."""
    v = group_values(vq, scale, zero, bits, group, codebook, out_idx, out_val)
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
