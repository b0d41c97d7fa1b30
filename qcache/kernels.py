"""The read path of a QuantLayer, in planes: unpack -> dequantize -> RoPE -> cast, plus a fused decode attention.

Codes are packed in planes (qcache/quant.py): byte j of a 4-bit key holds channels j and j + D/2, which is a RoPE
pair. So every step of the read works on contiguous channel slices ("planes") and never interleaves: each plane is
dequantized with its slice of the scales, a RoPE pair of planes is rotated together, and the planes are written
side by side. The eager read (`QuantLayer.read`) and the `torch.compile`d functions below call the same functions,
so `kernel="compiled"` reads exactly what `kernel="eager"` reads (up to a fused multiply-add in the last fp32 bit).
Written this way, inductor vectorizes the whole read (an unpack that interleaves or concatenates codes before the
arithmetic makes it fall back to scalar loops, measured 3-5x slower).

`decode_attention` goes one step further for one query token: scores and the weighted sum of values are computed
from the planes (fp32 throughout), so neither the dequantized keys nor the values are written out in the cache
dtype and read again. `QuantLayer` uses it through the `qcache_fp32` attention (qcache/attention.py).

The fused functions cover the common layout: every key block full, positions the same consecutive run in every row,
per-block key scales, with or without outliers and codebooks. `QuantLayer` reads any other layout (a crop that cut a
block, left padding, beams at different positions, static key ranges) with its eager code.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Hashable

import torch

from .quant import code_planes, dequantize, scatter_outliers, unpack
from .rope import apply_rope

__all__ = [
    "code_planes", "key_planes", "value_planes", "rotate_planes", "group_values", "read_keys",
    "read_values", "decode_attention", "compiled",
]


def key_planes(kq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
               codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
               out_val: torch.Tensor | None = None, cos: torch.Tensor | None = None,
               sin: torch.Tensor | None = None) -> list[torch.Tensor]:
    """fp32 keys as channel planes [B, H, Tq, w] from codes kq [B, H, Tq, D*bits/8] in full blocks of `group`
    tokens, scale/zero [B, H, Tq/group, D] per block and channel, outliers [B, H, Tq/group, m, D] (token offsets in
    the block, values) or None; RoPE re-applied (`rotate_planes`) when cos/sin are given, else before RoPE."""
    planes = []
    a = 0
    for codes in code_planes(kq, bits):
        B, H, Tq, w = codes.shape
        sl = slice(a, a + w)
        # [B, H, Tq, w] -> [B, H, Tq/group, group, w]: one scale/zero per block broadcast over its tokens
        x = dequantize(codes.view(B, H, Tq // group, group, w), scale[..., sl].unsqueeze(3),
                       zero[..., sl].unsqueeze(3), codebook=codebook)
        if out_idx is not None:
            scatter_outliers(x, 3, out_idx[..., sl], out_val[..., sl])
        planes.append(x.view(B, H, Tq, w))
        a += w
    return planes if cos is None else rotate_planes(planes, cos, sin)


def value_planes(vq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group: int,
                 codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
                 out_val: torch.Tensor | None = None) -> list[torch.Tensor]:
    """fp32 values as channel planes from codes with scale/zero [B, H, Tq, D/group] per token and channel group,
    outliers [B, H, Tq, D/group, m] (channel offsets in the group, values) or None."""
    planes = code_planes(vq, bits)
    w = planes[0].shape[-1]
    if w % group and group % w:  # planes and groups do not nest (e.g. D=48, group 16): one plane of all channels
        planes = [unpack(vq, bits)]
        w = planes[0].shape[-1]
    out = []
    for i, codes in enumerate(planes):
        B, H, Tq, _ = codes.shape
        a = i * w
        if w % group == 0:  # the plane holds whole groups
            g = slice(a // group, (a + w) // group)
            x = dequantize(codes.view(B, H, Tq, w // group, group), scale[..., g].unsqueeze(-1),
                           zero[..., g].unsqueeze(-1), codebook=codebook)
            if out_idx is not None:
                scatter_outliers(x, 4, out_idx[..., g, :], out_val[..., g, :])
            out.append(x.view(B, H, Tq, w))
            continue
        g = a // group  # the plane lies inside group g, at channel offset a % group
        x = dequantize(codes, scale[..., g:g + 1], zero[..., g:g + 1], codebook=codebook)
        if out_idx is not None:
            # the group's outliers that fall in this plane; the others go to a scratch column that is dropped
            rel = out_idx[..., g, :].long() - a % group  # [B, H, Tq, m]
            rel = torch.where((rel >= 0) & (rel < w), rel, w)
            x = torch.cat([x, x.new_zeros(B, H, Tq, 1)], dim=-1).scatter(-1, rel, out_val[..., g, :].to(x.dtype))
            x = x[..., :w]
        out.append(x)
    return out


def rotate_planes(planes: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """RoPE on channel planes (cos/sin [B or 1, Tq, R] fp32): plane i of the first half and plane i of the second
    half are RoPE pairs, rotated with `apply_rope_into`'s arithmetic (x1 cos - x2 sin, x2 cos + x1 sin). Partial
    rotary (R < D) rotates the concatenated planes with `apply_rope` instead (one plane back)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, Tq, R]
    w = planes[0].shape[-1]
    n = len(planes)
    if cos.shape[-1] != n * w or n % 2:
        return [apply_rope(torch.cat(planes, dim=-1), cos.squeeze(1), sin.squeeze(1))]
    half = n // 2
    out = [None] * n
    for i in range(half):
        x1, x2 = planes[i], planes[i + half]
        a, b = i * w, (i + half) * w
        # exactly apply_rope_into's operations: an addcmul here (one temporary fewer, ~25 % faster eager RoPE)
        # fuses a multiply-add, and that last-bit change flips enough codes downstream to move SmolLM2's 4-bit
        # perplexity by 0.1 % (measured): the published numbers would no longer reproduce
        out[i] = x1 * cos[..., a:a + w] - x2 * sin[..., a:a + w]
        out[i + half] = x2 * cos[..., b:b + w] + x1 * sin[..., b:b + w]
    return out


def group_values(vq, scale, zero, bits, group, codebook, out_idx=None, out_val=None) -> torch.Tensor:
    """`value_planes` side by side: fp32 values [B, H, Tq, D]."""
    return torch.cat(value_planes(vq, scale, zero, bits, group, codebook, out_idx, out_val), dim=-1)


def read_keys(sink: torch.Tensor, kq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              cos: torch.Tensor | None, sin: torch.Tensor | None, res: torch.Tensor, bits: int, group: int,
              codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
              out_val: torch.Tensor | None = None) -> torch.Tensor:
    """[sink | dequantized, re-rotated keys | residual] along the token axis in the cache dtype; cos/sin
    [1, Tq, R] fp32 (None: no RoPE); the rest as for `key_planes`."""
    planes = key_planes(kq, scale, zero, bits, group, codebook, out_idx, out_val, cos, sin)
    return torch.cat([sink, torch.cat(planes, dim=-1).to(sink.dtype), res], dim=2)


def read_values(sink: torch.Tensor, vq: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, res: torch.Tensor,
                bits: int, group: int, codebook: torch.Tensor | None, out_idx: torch.Tensor | None = None,
                out_val: torch.Tensor | None = None) -> torch.Tensor:
    """[sink | dequantized values | residual]; the rest as for `value_planes`."""
    planes = value_planes(vq, scale, zero, bits, group, codebook, out_idx, out_val)
    return torch.cat([sink, torch.cat(planes, dim=-1).to(sink.dtype), res], dim=2)


def decode_attention(q: torch.Tensor, fp_k: torch.Tensor, fp_v: torch.Tensor, n_sink: int, kq: torch.Tensor,
                     k_scale: torch.Tensor, k_zero: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                     vq: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, bias: torch.Tensor | None,
                     scaling: float, k_bits: int, k_group: int, v_bits: int, v_group: int,
                     k_codebook: torch.Tensor | None = None, v_codebook: torch.Tensor | None = None,
                     k_oi: torch.Tensor | None = None, k_ov: torch.Tensor | None = None,
                     v_oi: torch.Tensor | None = None, v_ov: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per head over [sinks | quantized | residual], all in fp32.

    q: [B, H, G, D] fp32 (the G query heads sharing kv head h); fp_k / fp_v: the full-precision tokens
    [sinks | residual] [B, H, S+R, D] in the cache dtype, the first `n_sink` of them sinks; bias: additive fp32
    [B, 1, 1, S+Tq+R] (0 or the fp32 minimum) or None; the quantized region as for `key_planes` / `value_planes`.
    Returns [B, H, G, D] fp32: softmax(q k^T * scaling + bias) v.

    The quantized keys and values are dequantized plane by plane (RoPE on the pairs) into fp32 and multiplied
    with one matmul each (measured faster under inductor than a fused multiply-sum, which recomputes the
    dequantization for each of the G query heads, or than one matmul per plane)."""
    kp = key_planes(kq, k_scale, k_zero, k_bits, k_group, k_codebook, k_oi, k_ov, cos, sin)
    S, Tq = n_sink, kq.shape[2]
    s_q = q @ torch.cat(kp, dim=-1).transpose(-1, -2)  # [B, H, G, Tq]
    s_fp = q @ fp_k.float().transpose(-1, -2)  # [B, H, G, S+R]
    scores = torch.cat([s_fp[..., :S], s_q, s_fp[..., S:]], dim=-1) * scaling  # key order of the cache
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    p_fp = torch.cat([probs[..., :S], probs[..., S + Tq:]], dim=-1)
    values = torch.cat(value_planes(vq, v_scale, v_zero, v_bits, v_group, v_codebook, v_oi, v_ov), dim=-1)
    return probs[..., S:S + Tq] @ values + p_fp @ fp_v.float()


_FUNCTIONS = {"read_keys": read_keys, "read_values": read_values, "decode_attention": decode_attention}
# the arguments whose size follows the token count, and the dimension that does
_TOKEN_DIMS = {
    "read_keys": {"kq": 2, "scale": 2, "zero": 2, "cos": 1, "sin": 1, "res": 2, "out_idx": 2, "out_val": 2},
    "read_values": {"vq": 2, "scale": 2, "zero": 2, "res": 2, "out_idx": 2, "out_val": 2},
    "decode_attention": {"fp_k": 2, "fp_v": 2, "kq": 2, "k_scale": 2, "k_zero": 2, "cos": 1, "sin": 1, "vq": 2,
                         "v_scale": 2, "v_zero": 2, "bias": 3, "k_oi": 2, "k_ov": 2, "v_oi": 2, "v_ov": 2},
}
_COMPILED: dict[tuple, object] = {}
_COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InductorError)


def _own_code(fn):
    """A copy of `fn` with a code object of its own. torch.compile keeps its compiled entries, and its limit of
    recompiles (8), per code object: each cache configuration gets its own budget instead of sharing one."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled(name: str, variant: Hashable = None):
    """The torch.compile'd `read_keys` / `read_values` / `decode_attention` for one cache configuration
    (`variant`: what a QuantLayer's settings make static), built on first use. Only the token dimensions are
    compiled as dynamic (they grow every step); head_dim, heads and group sizes stay static, so the inner loops
    have fixed trip counts and vectorize. Raises if torch.compile cannot build it here (e.g. no C++ compiler for
    the CPU backend)."""
    fn = _COMPILED.get((name, variant))
    if fn is None:
        compiled_fn = torch.compile(_own_code(_FUNCTIONS[name]))
        params = list(inspect.signature(_FUNCTIONS[name]).parameters)
        dims = [(params.index(arg), dim) for arg, dim in _TOKEN_DIMS[name].items()]  # (position, dim)

        def fn(*args):
            for i, d in dims:
                if i < len(args) and isinstance(args[i], torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(args[i], d)
            try:
                return compiled_fn(*args)
            except _COMPILE_ERRORS as e:
                raise RuntimeError(
                    f"kernel='compiled': torch.compile could not build qcache's {name} here ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); it needs a working C++ compiler on CPU (Triton on "
                    "GPU). Allowed instead: kernel='eager' (same values, slower decode)"
                ) from e

        _COMPILED[(name, variant)] = fn
    return fn
