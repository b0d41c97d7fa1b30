"""The read path of a QuantLayer: decode the codes (qcache/codec.py) -> re-apply RoPE -> cast, and a fused decode
attention that attends straight from the codes.

Codes are packed in planes (qcache/quant.py): byte j of a 4-bit key holds channels j and j + D/2, which is a RoPE
pair. So every step works on contiguous channel slices ("planes") and never interleaves: the codec decodes each
plane with its slice of the scales, a RoPE pair of planes is rotated together, and the planes are written side by
side. RoPE is re-applied by angle addition from two small factors (qcache/rope.py, `compose`), so no cos/sin table
of every position is read or kept. The eager read (`QuantLayer.read`) and the `torch.compile`d functions below call
the same functions, so `kernel="compiled"` reads exactly what `kernel="eager"` reads (up to a fused multiply-add in
the last fp32 bit). Written this way, inductor vectorizes the whole read (an unpack that interleaves or concatenates
codes before the arithmetic makes it fall back to scalar loops, measured 3-5x slower).

`decode_attention` goes one step further for one query token: scores and the weighted sum of values are computed
from the planes (fp32 throughout), so neither the dequantized keys nor the values are written out in the cache
dtype and read again. `QuantLayer` uses it through the `qcache_fp32` attention (qcache/attention.py).

Every function takes the quantized region as a `Quantized` (the store's views and the codecs' per-layer tensors)
and the codecs themselves (frozen descriptions: compiled code specializes on them, not on a layer's tensors).
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Hashable
from typing import NamedTuple

import torch

from .codec import KeyCodec, ValueCodec
from .quant import nearest_levels_unrolled
from .rope import compose, rotate_half_width

__all__ = ["Quantized", "key_planes", "rotate_planes", "read_keys", "read_values", "decode_attention", "compiled",
           "resolve_kernel", "resolve_decode"]


class Quantized(NamedTuple):
    """The quantized region of a layer, as the kernels read it.

    k / v: {part name: view [B, H, n or blocks, ...]} from the store; k_consts / v_consts: the codecs' per-layer
    tensors (codebook, static ranges, rotation); rope: `RopeHelper.factors` of the region's positions, or None (no
    RoPE)."""

    k: dict
    v: dict
    k_consts: dict
    v_consts: dict
    rope: tuple | None


def rotate_planes(planes: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """RoPE on channel planes with half-width cos/sin [B or 1, n, R/2]: plane i of the first half and plane i of the
    second half are RoPE pairs, rotated with `rotate_half_width`'s arithmetic (x1 cos - x2 sin, x2 cos + x1 sin).
    Partial rotary (R < D) or planes that do not align with R/2 rotate the concatenated planes (one plane back)."""
    w, n = planes[0].shape[-1], len(planes)
    if 2 * cos.shape[-1] != n * w or n % 2:
        return [rotate_half_width(torch.cat(planes, dim=-1), cos, sin)]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, n, R/2]
    half = n // 2
    out = [None] * n
    for i in range(half):
        x1, x2 = planes[i], planes[i + half]
        c, s = cos[..., i * w:(i + 1) * w], sin[..., i * w:(i + 1) * w]
        out[i] = x1 * c - x2 * s
        out[i + half] = x2 * c + x1 * s
    return out


def key_planes(q: Quantized, k_codec: KeyCodec) -> list[torch.Tensor]:
    """fp32 keys of the quantized region as channel planes [B, H, Tq, w], RoPE re-applied when `q.rope` is set."""
    planes = k_codec.planes(q.k, q.k_consts)
    if q.rope is None:
        return planes
    cos, sin = compose(q.rope, planes[0].shape[2])
    return rotate_planes(planes, cos, sin)


def read_keys(sink: torch.Tensor, q: Quantized, res: torch.Tensor, k_codec: KeyCodec) -> torch.Tensor:
    """[sink | dequantized, re-rotated keys | residual] along the token axis, in the cache dtype."""
    planes = key_planes(q, k_codec)
    return torch.cat([sink, torch.cat(planes, dim=-1).to(sink.dtype), res], dim=2)


def read_values(sink: torch.Tensor, q: Quantized, res: torch.Tensor, v_codec: ValueCodec) -> torch.Tensor:
    """[sink | dequantized values | residual] along the token axis, in the cache dtype."""
    planes = v_codec.planes(q.v, q.v_consts)
    return torch.cat([sink, torch.cat(planes, dim=-1).to(sink.dtype), res], dim=2)


def decode_attention(query: torch.Tensor, fp_k: torch.Tensor, fp_v: torch.Tensor, bias: torch.Tensor | None,
                     q: Quantized, n_sink: int, scaling: float, k_codec: KeyCodec, v_codec: ValueCodec
                     ) -> torch.Tensor:
    """Attention of one query token per head over [sinks | quantized | residual], all in fp32.

    query: [B, H, G, D] fp32 (the G query heads sharing kv head h); fp_k / fp_v: the full-precision tokens
    [sinks | residual] [B, H, S+R, D] in the cache dtype, the first `n_sink` of them sinks; bias: additive fp32
    [B, 1, 1, S+Tq+R] (0 or the fp32 minimum) or None. Returns [B, H, G, D] fp32: softmax(q k^T * scaling + bias) v.

    The quantized keys and values are dequantized plane by plane (RoPE on the pairs) into fp32 and multiplied
    with one matmul each (measured faster under inductor than a fused multiply-sum, which recomputes the
    dequantization for each of the G query heads, or than one matmul per plane). With `rotation`, the keys are
    un-rotated per token before RoPE (RoPE does not commute with the rotation) and the values once, in the output
    [B, H, G, D] rather than per token."""
    keys = torch.cat(key_planes(q, k_codec), dim=-1)  # [B, H, Tq, D]
    S, Tq = n_sink, keys.shape[2]
    s_q = query @ keys.transpose(-1, -2)  # [B, H, G, Tq]
    s_fp = query @ fp_k.float().transpose(-1, -2)  # [B, H, G, S+R]
    scores = torch.cat([s_fp[..., :S], s_q, s_fp[..., S:]], dim=-1) * scaling  # key order of the cache
    if bias is not None:
        scores = scores + bias
    probs = torch.softmax(scores, dim=-1)
    p_fp = torch.cat([probs[..., :S], probs[..., S + Tq:]], dim=-1)
    # with a rotation the values stay rotated and the weighted sum is un-rotated once: (P V R) R^T = P V
    values = torch.cat(v_codec.planes(q.v, q.v_consts, rotated=True), dim=-1)  # [B, H, Tq, D]
    return v_codec.unrotate(probs[..., S:S + Tq] @ values, q.v_consts) + p_fp @ fp_v.float()


logger = logging.getLogger(__name__)

_FUNCTIONS = {"read_keys": read_keys, "read_values": read_values, "decode_attention": decode_attention,
              "nearest_levels": nearest_levels_unrolled}
_COMPILED: dict[tuple, object] = {}
_COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InductorError)


def _own_code(fn):
    """A copy of `fn` with a code object of its own. torch.compile keeps its compiled entries, and its limit of
    recompiles (8), per code object: each cache configuration gets its own budget instead of sharing one."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


# positional tensor arguments whose size follows the context, and the dimension that does (Quantized arguments are
# marked by `_mark_token_dims`)
_TOKEN_DIMS = {"read_keys": {0: 2, 2: 2}, "read_values": {0: 2, 2: 2}, "decode_attention": {1: 2, 2: 2, 3: 3},
               "nearest_levels": {0: 2}}


def _mark_token_dims(q: Quantized) -> None:
    """Mark the dimensions that grow with the context as dynamic: dim 2 of the stored [B, H, n, ...] tensors and dim
    1 of the block-start RoPE factors [B, nb, R/2] (and the batch dim of the stored tensors). Everything else (head_dim, heads, groups, offsets) stays static,
    so the inner loops have fixed trip counts and vectorize."""
    for part in (*q.k.values(), *q.v.values()):
        torch._dynamo.maybe_mark_dynamic(part, 2)
        torch._dynamo.maybe_mark_dynamic(part, 0)  # batch: beams and batched prompts reuse the same compile
    if q.rope is not None:
        torch._dynamo.maybe_mark_dynamic(q.rope[0], 1)
        torch._dynamo.maybe_mark_dynamic(q.rope[1], 1)


def compiled(name: str, variant: Hashable = None):
    """The torch.compile'd `read_keys` / `read_values` / `decode_attention` (or the encoder's `nearest_levels`,
    the same codes as `quant.nearest_levels`) for one cache configuration
    (`variant`: what a QuantLayer's settings make static: its codecs, dtype, RoPE or not), built on first use.
    Raises if torch.compile cannot build it here (e.g. no C++ compiler for the CPU backend)."""
    fn = _COMPILED.get((name, variant))
    if fn is None:
        compiled_fn = torch.compile(_own_code(_FUNCTIONS[name]))

        dims = _TOKEN_DIMS[name]

        def fn(*args):
            for i, a in enumerate(args):
                if isinstance(a, Quantized):
                    _mark_token_dims(a)
                elif isinstance(a, torch.Tensor) and i in dims:
                    torch._dynamo.maybe_mark_dynamic(a, dims[i])
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


_COMPILER_WORKS: dict[str, bool] = {}  # device type -> whether torch.compile built and ran a probe there


def _probe(x: torch.Tensor) -> torch.Tensor:
    return (x.float() * 2 + 1).to(x.dtype)


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """The read path a cache configured with `kernel` uses on `device`: "auto" becomes "compiled" where
    torch.compile builds and runs a small probe on that device type (tried once per process and device type) and
    "eager" elsewhere, logged once at INFO either way; QCACHE_KERNEL=eager|compiled overrides "auto"."""
    if kernel in ("eager", "compiled"):
        return kernel
    forced = _forced()
    if forced in ("eager", "compiled") and kernel == "auto":
        return forced
    kind = torch.device(device).type
    if kind not in _COMPILER_WORKS:
        try:
            torch.compile(_own_code(_probe), dynamic=False)(torch.ones(8, device=device))
            _COMPILER_WORKS[kind] = True
            logger.info("qcache: kernel='auto' reads the cache with torch.compile'd kernels on %s (a one-time compile "
                        "per cache configuration)", kind)
        except Exception as err:  # any failure to build or run means: not here  # noqa: BLE001
            _COMPILER_WORKS[kind] = False
            logger.info("qcache: kernel='auto' reads the cache eagerly on %s: torch.compile does not work here "
                        "(%s: %s); decode is slower (install a C++ compiler on CPU, Triton on GPU)", kind,
                        type(err).__name__, " ".join(str(err).split())[:300])
    return "compiled" if _COMPILER_WORKS[kind] else "eager"


_FORCED = ("eager", "compiled", "native")
_LOGGED: set[tuple] = set()


def _forced() -> str | None:
    forced = os.environ.get("QCACHE_KERNEL")
    if forced and forced not in _FORCED:
        raise ValueError(f"QCACHE_KERNEL={forced!r} is not supported; allowed values: {list(_FORCED)}")
    return forced or None


def resolve_decode(kernel: str, device: torch.device, k_codec: KeyCodec, v_codec: ValueCodec, head_dim: int,
                   k_consts: dict, v_head_dim: int | None = None) -> tuple[str, str | None]:
    """(read, decode) for a block layer configured with `kernel` on `device`: the read path ("eager" or "compiled")
    and what attends from the codes at a decode step ("native": qcache's own kernel for the device, the C kernel of
    qcache/native.py on CPU, the Triton kernels of qcache/triton_decode.py on CUDA; "compiled": the
    torch.compile'd `decode_attention`, None: attention gets the read). "eager" is (eager, None), "compiled"
    (compiled, compiled), "native" (the read "auto" gives, native) and raises where the C kernel cannot serve this
    layer; "auto" (or QCACHE_KERNEL) takes native where it builds and reads this configuration, else the
    compiled decode where torch.compile works, else none."""
    from . import native

    if kernel == "auto":
        kernel = _forced() or "auto"
    if kernel == "eager":
        return "eager", None
    if kernel == "compiled":
        return "compiled", "compiled"
    kind = torch.device(device).type
    if v_head_dim not in (None, head_dim):
        reason = f"keys of head_dim {head_dim} and values of {v_head_dim} (one width for both)"
    elif kind == "cpu":
        reason = native.unsupported(k_codec, v_codec, head_dim, 1, k_consts)
    elif kind == "cuda":
        reason = _triton_unsupported(k_codec, v_codec, head_dim)
    else:
        reason = f"a {kind} device (qcache's own decode kernels run on CPU and CUDA)"
    if kernel == "native":
        if reason is not None:
            raise ValueError(f"kernel='native' cannot serve this layer ({reason}); allowed: kernel='auto', 'compiled' "
                             "or 'eager'")
        if kind == "cpu":
            native._load()  # raises with the way out where the C compiler is missing
        return resolve_kernel("auto", device), "native"
    read = resolve_kernel("auto", device)
    if reason is None and kind == "cpu" and not native.available():
        reason = "qcache's C kernel does not build here (a C compiler with OpenMP is needed)"
    decode = "native" if reason is None else ("compiled" if read == "compiled" else None)
    key = (kind, decode, reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("qcache: kernel='auto' decodes from the codes with %s on %s%s", decode or "no fused kernel", kind,
                    "" if reason is None else f" (the C kernel does not: {reason})")
    return read, decode


def _triton_unsupported(k_codec: KeyCodec, v_codec: ValueCodec, head_dim: int) -> str | None:
    """What of a layer's codecs the Triton decode kernels cannot read, known before the layer holds tokens (the
    rest, from the stored tensors, is checked at each call: `triton_decode.unsupported`)."""
    from . import triton_decode

    error = triton_decode._triton_error()
    if error is not None:
        return f"triton is not importable ({error})"
    if k_codec.outliers or v_codec.outliers:
        return "outliers"
    if k_codec.static:
        return "static key ranges"
    if head_dim % 8 or head_dim > triton_decode._MAX_D or (k_codec.rotation and head_dim > triton_decode._MAX_D_ROTATED):
        return f"head_dim {head_dim} (rotated keys up to {triton_decode._MAX_D_ROTATED}, else up to {triton_decode._MAX_D})"
    if not v_codec.norm and head_dim % v_codec.group:
        return f"value groups of {v_codec.group} channels do not tile head_dim {head_dim}"
    return None
