"""qcache's own CPU decode attention: one C function (qcache/csrc/decode.c) that attends from the packed codes.

At a decode step a `BlockLayer` whose kernel is "native" hands attention its codes (qcache/handover.py) and
`decode_attention` here answers it: the same contract and the same numbers (fp32 throughout) as
`qcache.kernels.decode_attention`, but each packed byte of the quantized region is read once, in cache-sized tiles,
with nothing written back to memory but the partial sums of each chunk of tokens:

- keys: unpacked, dequantized with their block's per-channel scale and zero, un-rotated with a Walsh-Hadamard
  butterfly (D log D operations per token instead of the D x D product of `x @ R.T`), RoPE re-applied by angle
  addition, scored against the G query rows of their kv head;
- values: unpacked and weighted into a per-chunk online softmax (running max, sum, weighted sum in rotated space);
- the full-precision tokens (the sinks; with `window_bits=16` the residual too) as they are, and the 8-bit residual
  window from its codes (`Window`): its keys scored against the query turned into their space once (q R for rotated
  window keys, so no key is un-rotated), its values weighted from their codes, into one more online softmax;
- a second pass in the same call merges each query row's partials and un-rotates the region's values once (a
  butterfly on the [D] output row), so torch only prepares the pointers: no dequantized window, no merge in torch.

The same library codes tokens (qcache/csrc/encode.c): `encode_tokens` (min-max and norm-scaled tokens) and
`encode_keys` (key blocks) give `codec.encode`'s parts, which layers with a native kernel store (docs/design.md,
"Coding in C").

The C sources are compiled once per machine with the system C compiler (`$CC`, else `cc`) at `-O3 -march=native
-fopenmp` into `$QCACHE_HOME/kernels` (default ~/.cache/qcache/kernels), written atomically, and loaded with ctypes.
OpenMP binds to the runtime torch has already loaded (libgomp), so the kernel and torch share one thread pool; it
runs on `torch.get_num_threads()` threads. `available()` says whether the build works here; `unsupported()` names
the configurations the kernel does not read (outliers, static key ranges, rotations other than the randomized
Hadamard), for which `kernel="auto"` keeps the torch.compile'd decode.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .codec import _NORM_ROUNDS, KeyCodec, ValueCodec
from .quant import pack

__all__ = ["available", "unsupported", "window_unsupported", "decode_attention", "library_path", "Window",
           "encode_tokens", "encode_keys", "norm_fit"]

_SOURCES = [Path(__file__).with_name("csrc") / name for name in ("decode.c", "encode.c")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=fast"]
_CHUNK = 256  # tokens per work item: 32 items per kv head at 8192 tokens
_MAX_D, _MAX_G = 256, 64  # the C function's stack tiles
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_fold_cache = WeakTensorKeyDictionary()  # rotation matrix -> its fold (per live tensor: no stale address reuse)


def _compiler() -> str:
    return os.environ.get("CC") or "cc"


def _cpu() -> str:
    """What `-march=native` compiles for: the CPU's model and feature flags (Linux), else the machine type."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(sorted({line for line in info if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.machine() + platform.processor()


def library_path() -> Path:
    """Where the compiled kernel lives: a name from the hash of its source, compiler, flags and CPU (a home directory
    shared by machines of other CPUs gets one library per CPU)."""
    root = Path(os.environ.get("QCACHE_HOME") or Path.home() / ".cache" / "qcache").expanduser() / "kernels"
    key = b"".join(src.read_bytes() for src in _SOURCES) + " ".join([_compiler(), *_FLAGS, _cpu()]).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return root / f"decode-{digest}.so"


def _build(path: Path) -> None:
    cc = shutil.which(_compiler())
    if cc is None:
        raise RuntimeError(f"no C compiler {_compiler()!r} on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> ctypes.CDLL:
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                path = library_path()
                if not path.exists():
                    _build(path)
                lib = ctypes.CDLL(str(path))
                fn = lib.qcache_decode_attention
                fn.argtypes = [ctypes.POINTER(_Args)]
                fn.restype = ctypes.c_int
                enc = lib.qcache_encode_norm
                enc.argtypes = [_P, _I, _I, _P, _I, _I, _P, _P, _I]
                enc.restype = ctypes.c_int
                enc = lib.qcache_encode_minmax
                enc.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _I]
                enc.restype = ctypes.c_int
                enc = lib.qcache_encode_keys
                enc.argtypes = [_P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _I]
                enc.restype = ctypes.c_int
                _lib = lib
            except Exception as err:  # noqa: BLE001 - any failure to build or load means: not here
                _error = f"{type(err).__name__}: {err}"
        if _lib is None:
            raise RuntimeError(f"kernel='native': qcache's C decode kernel could not be built or loaded here ({_error});"
                               " it needs a C compiler with OpenMP ($CC or cc). Allowed instead: kernel='compiled' or "
                               "kernel='eager' (same values)")
        return _lib


def available() -> bool:
    """Whether the C kernel builds and loads on this machine (tried once per process)."""
    try:
        _load()
        return True
    except RuntimeError:
        return False


def _hadamard_fold(rotation: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """For R = blockdiag(H_b) diag(s) / sqrt(b) (qcache/rotation.py): (s / sqrt(b) [D] fp32, b), so that x @ R.T is
    the Walsh-Hadamard butterfly of x * s / sqrt(b) within blocks of b channels. None for any other matrix."""
    if rotation in _fold_cache:
        return _fold_cache[rotation]
    D = rotation.shape[0]
    b = D & -D
    idx = torch.arange(D)
    fold = rotation[(idx // b) * b, idx].float()
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    rebuilt = torch.block_diag(*[h] * (D // b)).to(rotation.device) * fold[None, :]
    result = (fold.contiguous(), b) if torch.allclose(rebuilt, rotation.float(), atol=1e-6) else None
    _fold_cache[rotation] = result
    return result


def unsupported(k_codec: KeyCodec, v_codec: ValueCodec, head_dim: int, groups: int, k_consts: dict | None = None
                ) -> str | None:
    """None when the C kernel reads this configuration; else why not, in a line."""
    if k_codec.outliers or v_codec.outliers:
        return "outliers"
    if k_codec.static:
        return "static key ranges"
    if head_dim > _MAX_D or head_dim % 8 or groups > _MAX_G:
        return (f"head_dim {head_dim} (allowed: a multiple of 8 up to {_MAX_D}) or {groups} query heads per kv head "
                f"(allowed: up to {_MAX_G})")
    if k_codec.group % 8:
        return f"key blocks of {k_codec.group} tokens (the kernel reads tiles of 8)"
    if head_dim % v_codec.group:
        return f"value groups of {v_codec.group} channels do not divide head_dim {head_dim}"
    if k_codec.rotation and k_consts is not None and _hadamard_fold(k_consts["rotation"]) is None:
        return "a key rotation that is not the randomized Hadamard of qcache/rotation.py"
    return None


class Window(NamedTuple):
    """The 8-bit residual window as the kernel reads it: {part name: view [B, H, R, ...]} of its keys and values,
    their token codecs (`layout.window_codecs`) and the codecs' constants (the keys' rotation)."""

    k: dict
    v: dict
    k_codec: ValueCodec
    v_codec: ValueCodec
    k_consts: dict
    v_consts: dict


def window_unsupported(codecs: tuple[ValueCodec, ValueCodec] | None, consts: tuple[dict, dict] | None) -> str | None:
    """None when the kernel reads a residual window of these token codecs from its codes (8-bit min-max per token and
    head, keys rotated by the randomized Hadamard or not, values unrotated); else why not (the caller then hands it
    over dequantized, as full-precision tokens)."""
    if codecs is None:
        return "a residual kept as given"
    for codec in codecs:
        if codec.bits != 8 or codec.norm or codec.codebook or codec.outliers:
            return f"window tokens coded as {codec} (the kernel reads 8-bit min-max tokens)"
    if codecs[1].rotation:
        return "rotated window values"
    if codecs[0].rotation and _hadamard_fold(consts[0]["rotation"]) is None:
        return "a window key rotation that is not the randomized Hadamard of qcache/rotation.py"
    return None


class _Tensor(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("sb", ctypes.c_int64), ("sh", ctypes.c_int64), ("st", ctypes.c_int64),
                ("dtype", ctypes.c_int64)]


_T, _I, _P = _Tensor, ctypes.c_int64, ctypes.c_void_p


class _Args(ctypes.Structure):  # qc_args of decode.c, field for field
    _fields_ = ([(n, _I) for n in ("B", "H", "G", "D", "T", "S", "group", "kbits", "vbits", "vgroup", "rh", "chunk",
                                   "threads")]
                + [("scaling", ctypes.c_double), ("kcodes", _T), ("kscale", _T), ("kzero", _T), ("klev", _P),
                   ("kfold", _P), ("krot", _I), ("bcos", _T), ("bsin", _T), ("ocos", _P), ("osin", _P),
                   ("vcodes", _T), ("vscale", _T), ("vzero", _T), ("vlev", _P), ("vfold", _P), ("vrot", _I),
                   ("fk", _T), ("fv", _T), ("nf", _I), ("wkc", _T), ("wks", _T), ("wkz", _T), ("wvc", _T),
                   ("wvs", _T), ("wvz", _T), ("nw", _I), ("wkfold", _P), ("wkrot", _I), ("query", _P), ("bias", _T),
                   ("out", _P)])


_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.uint8: 3, torch.bool: 3}


def _tensor(t: torch.Tensor | None, batch: int | None = None) -> _Tensor:
    """A [B, H, n, ...] tensor (or [B, n, ...] with `batch`: its batch size, a broadcast batch of 1 read with stride
    0) for the kernel: pointer, strides of batch row, head and token, dtype. Its last dimension must be contiguous."""
    if t is None:
        return _Tensor()
    if t.dtype not in _DTYPES:
        t = t.float()
    if t.dim() > 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"a tensor of shape {tuple(t.shape)} with last stride {t.stride(-1)}; the kernel reads rows")
    st = t.stride()
    if batch is not None:
        return _Tensor(t.data_ptr(), 0 if t.shape[0] == 1 else st[0], 0, st[1] if t.dim() > 1 else 0, _DTYPES[t.dtype])
    return _Tensor(t.data_ptr(), st[0], st[1], st[2], _DTYPES[t.dtype])


_levels_cache = WeakTensorKeyDictionary()  # codebook -> its levels as the kernel reads them
_transposed = WeakTensorKeyDictionary()  # RoPE offset table [group, h] -> [h, group]


def _levels(codec, consts: dict, qmax_units: bool) -> torch.Tensor | None:
    """The level of each code (in units of a step with `qmax_units`, as `quant.dequantize` reads a codebook), fp32;
    None for uniform levels (the kernel converts the code itself). Kept per live codebook tensor."""
    if not codec.codebook:
        return None
    cb = consts["codebook"]
    found = _levels_cache.get(cb)
    if found is None:
        found = _levels_cache[cb] = {}
    if qmax_units not in found:
        cb32 = cb.float().cpu()
        found[qmax_units] = (cb32 * (cb32.numel() - 1) if qmax_units else cb32).contiguous()
    return found[qmax_units]


def _offsets_t(t: torch.Tensor) -> torch.Tensor:
    found = _transposed.get(t)
    if found is None:
        found = _transposed[t] = t.float().t().contiguous()
    return found


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fold(codec, consts: dict) -> tuple[torch.Tensor | None, int]:
    if not codec.rotation:
        return None, 0
    return _hadamard_fold(consts["rotation"])


def decode_attention(query: torch.Tensor, fp_k: torch.Tensor, fp_v: torch.Tensor, bias: torch.Tensor | None, q,
                     n_sink: int, scaling: float, k_codec: KeyCodec, v_codec: ValueCodec,
                     window: Window | None = None) -> torch.Tensor:
    """`qcache.kernels.decode_attention` (same arguments, same result) computed by the C kernel on CPU tensors, in
    one call.

    fp_k / fp_v: the full-precision tokens [sinks | residual] [B, H, S + R, D] in the cache dtype; or, with
    `window` (the residual's 8-bit codes, read by the kernel: `window_unsupported` says which it reads), the sinks
    [B, H, S, D] alone. bias: None, additive [B or 1, 1, 1, T_held] (fp32 or another float dtype) or a bool mask of
    that shape (True = attend, as `BlockLayer.decode_attention` takes it; masked tokens get the fp32 minimum, as the
    reference's additive mask)."""
    B, H, G, D = query.shape
    reason = unsupported(k_codec, v_codec, D, G, q.k_consts)
    if reason is None and v_codec.rotation and _hadamard_fold(q.v_consts["rotation"]) is None:
        reason = "a value rotation that is not the randomized Hadamard of qcache/rotation.py"
    if reason is None and window is not None:
        reason = window_unsupported((window.k_codec, window.v_codec), (window.k_consts, window.v_consts))
    if reason is not None:
        raise ValueError(f"kernel='native' cannot read this layer's codes ({reason}); allowed there: kernel='compiled' "
                         "or kernel='eager'")
    if query.device.type != "cpu":
        raise ValueError(f"kernel='native' runs on CPU tensors; got {query.device}")
    if fp_v.shape[-1] != D:
        raise ValueError(f"kernel='native' reads values of the keys' head_dim {D}; got {fp_v.shape[-1]}")
    lib = _load()
    a = _Args()
    kc = q.k[k_codec.prefix + "codes"]
    T = kc.shape[2]
    a.B, a.H, a.G, a.D, a.T, a.S = B, H, G, D, T, n_sink
    a.group, a.kbits, a.vbits, a.vgroup = k_codec.group, k_codec.bits, v_codec.bits, v_codec.group
    a.chunk, a.threads, a.scaling = _CHUNK, torch.get_num_threads(), float(scaling)
    a.kcodes, a.kscale, a.kzero = _tensor(kc), _tensor(q.k[k_codec.prefix + "scale"]), _tensor(q.k[k_codec.prefix + "zero"])
    klev = _levels(k_codec, q.k_consts, True)
    kfold, a.krot = _fold(k_codec, q.k_consts)
    a.klev, a.kfold = _ptr(klev), _ptr(kfold)
    ocos = osin = None
    if q.rope is not None:
        block_cos, block_sin, off_cos, off_sin = q.rope
        a.rh = block_cos.shape[-1]
        if off_cos.shape[0] != k_codec.group:
            raise ValueError(f"RoPE offset table of {off_cos.shape[0]} rows for key blocks of {k_codec.group} tokens")
        a.bcos, a.bsin = _tensor(block_cos.float(), batch=B), _tensor(block_sin.float(), batch=B)
        ocos, osin = _offsets_t(off_cos), _offsets_t(off_sin)
        a.ocos, a.osin = ocos.data_ptr(), osin.data_ptr()
    a.vcodes, a.vscale = _tensor(q.v[v_codec.prefix + "codes"]), _tensor(q.v[v_codec.prefix + "scale"])
    a.vzero = _tensor(None if v_codec.norm else q.v[v_codec.prefix + "zero"])
    vlev = _levels(v_codec, q.v_consts, not v_codec.norm)
    vfold, a.vrot = _fold(v_codec, q.v_consts)
    a.vlev, a.vfold = _ptr(vlev), _ptr(vfold)
    a.fk, a.fv, a.nf = _tensor(fp_k), _tensor(fp_v), fp_k.shape[2]
    wkfold = None
    if window is not None:
        ck, cv = window.k_codec, window.v_codec
        a.wkc, a.wks, a.wkz = (_tensor(window.k[ck.prefix + n]) for n in ("codes", "scale", "zero"))
        a.wvc, a.wvs, a.wvz = (_tensor(window.v[cv.prefix + n]) for n in ("codes", "scale", "zero"))
        a.nw = window.k[ck.prefix + "codes"].shape[2]
        wkfold, a.wkrot = _fold(ck, window.k_consts)
        a.wkfold = _ptr(wkfold)
    qry = query.float().contiguous()
    a.query = qry.data_ptr()
    if bias is not None:
        bias = bias.reshape(bias.shape[0], bias.shape[-1])
        if bias.dtype != torch.bool and bias.dtype != torch.float32:
            bias = bias.float()
        if bias.shape[-1] != T + a.nf + a.nw or bias.shape[0] not in (1, B):
            raise ValueError(f"a mask of shape {tuple(bias.shape)} for {B} rows of {T + a.nf + a.nw} tokens")
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
        a.bias = _tensor(bias, batch=B)
    out = torch.empty(B, H, G, D)
    a.out = out.data_ptr()
    rc = lib.qcache_decode_attention(ctypes.byref(a))
    if rc:
        raise ValueError(f"qcache's C decode kernel refused its arguments (code {rc}): T={T}, block {k_codec.group}")
    return out


def _plain_minmax(codec) -> bool:
    """Whether the C encoder's min-max path codes `codec`: fp16 scales, uniform levels, no outliers, no clip search."""
    return (not codec.codebook and not codec.outliers and codec.clip_ratios == (1.0,)
            and codec.scale_dtype == torch.float16)


def _minmax_parts(codec, rc: int, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                  what: str) -> dict[str, torch.Tensor] | None:
    """The parts of a min-max C encoder call that returned `rc` (2: a range overflows fp16, None so that the torch
    encoder codes it and raises; any other non-zero: refused arguments, described by `what`)."""
    if rc == 2:
        return None
    if rc:
        raise ValueError(f"qcache's C encoder refused its arguments (code {rc}): {what}")
    return {codec.prefix + "codes": pack(codes, codec.bits), codec.prefix + "scale": scale,
            codec.prefix + "zero": zero}


def encode_tokens(codec: ValueCodec, x: torch.Tensor, consts: dict) -> dict[str, torch.Tensor] | None:
    """`codec.encode`'s parts for tokens x [..., D] already in the codec's space (rotated if it rotates), computed by
    qcache's C encoder (qcache/csrc/encode.c): norm-scaled tokens (`norm_fit`) and min-max tokens with fp16 scales
    and no codebook, outliers or clip search (the same codes, scales and zeros as the torch encoder). None for any
    other codec, or a group whose range overflows fp16: the torch encoder then codes it (and raises for the
    overflow)."""
    if x.device.type != "cpu":
        return None
    if codec.norm:
        codes, scale = norm_fit(x, codec._levels(consts), _NORM_ROUNDS)
        return {codec.prefix + "codes": pack(codes, codec.bits), codec.prefix + "scale": scale.to(codec.scale_dtype)}
    if not _plain_minmax(codec) or x.shape[-1] % codec.group:
        return None
    lib = _load()
    x = x.float().contiguous()
    D = x.shape[-1]
    n = x.numel() // D if D else 0
    codes = torch.empty(x.shape, dtype=torch.uint8)
    scale = torch.empty(*x.shape[:-1], D // codec.group, dtype=torch.float16)
    zero = torch.empty_like(scale)
    rc = 0
    if n:
        rc = lib.qcache_encode_minmax(x.data_ptr(), n, D, codec.group, codec.bits, codes.data_ptr(), scale.data_ptr(),
                                      zero.data_ptr(), torch.get_num_threads())
    return _minmax_parts(codec, rc, codes, scale, zero, f"head_dim {D}, groups of {codec.group}, {codec.bits} bits")


def encode_keys(codec: KeyCodec, k: torch.Tensor, consts: dict, valid: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor] | None:
    """`codec.encode`'s parts for keys k [B, H, n, D] already in the codec's space, computed by qcache's C encoder:
    per-channel block ranges with fp16 scales and no codebook, outliers, clip search or static ranges (the same codes,
    scales and zeros as the torch encoder); `valid` [B, 1, n, 1] bool leaves padding out of the ranges. None for any
    other codec or a range that overflows fp16 (the torch encoder then codes it, and raises for the overflow)."""
    if (k.device.type != "cpu" or k.dim() != 4 or not _plain_minmax(codec) or codec.static
            or k.shape[2] % codec.group or k.shape[-1] > 1024):
        return None
    lib = _load()
    B, H, n, D = k.shape
    k = k.float().contiguous()
    ok = None if valid is None else valid.reshape(valid.shape[0], -1).expand(B, n).to(torch.uint8).contiguous()
    codes = torch.empty(B, H, n, D, dtype=torch.uint8)
    scale = torch.empty(B, H, n // codec.group, D, dtype=torch.float16)
    zero = torch.empty_like(scale)
    rc = 0
    if codes.numel():
        rc = lib.qcache_encode_keys(k.data_ptr(), None if ok is None else ok.data_ptr(), B, H, n, D, codec.group,
                                    codec.bits, codes.data_ptr(), scale.data_ptr(), zero.data_ptr(),
                                    torch.get_num_threads())
    return _minmax_parts(codec, rc, codes, scale, zero,
                         f"keys of shape {(B, H, n, D)}, blocks of {codec.group}, {codec.bits} bits")


def norm_fit(x: torch.Tensor, levels: torch.Tensor, rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What `ValueCodec(norm=True)` fits for rotated fp32 tokens x [..., D] on the CPU (qcache/csrc/encode.c): the
    uint8 index of each channel's level [..., D] and each token's least-squares scale [..., 1] fp32, after `rounds`
    rounds from the token's RMS. The same arithmetic as the torch encoder in one pass over x; its sums run in another
    order, so a scale may differ in its last fp32 bit."""
    if x.device.type != "cpu":
        raise ValueError(f"qcache's C encoder runs on CPU tensors; got {x.device}")
    lib = _load()
    x = x.float().contiguous()
    lev = levels.float().cpu().contiguous()
    D = x.shape[-1]
    n = x.numel() // D if D else 0
    codes = torch.empty(x.shape, dtype=torch.uint8)
    scale = torch.empty(*x.shape[:-1], 1)
    if n:
        rc = lib.qcache_encode_norm(x.data_ptr(), n, D, lev.data_ptr(), lev.numel(), rounds, codes.data_ptr(),
                                    scale.data_ptr(), torch.get_num_threads())
        if rc:
            raise ValueError(f"qcache's C encoder refused its arguments (code {rc}): {lev.numel()} levels, head_dim "
                             f"{D}, {rounds} rounds")
    return codes, scale
