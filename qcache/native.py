"""qcache's own CPU decode attention: one C function (qcache/csrc/decode.c) that attends from the packed codes.

At a decode step a `BlockLayer` whose kernel is "native" hands attention its codes (qcache/handover.py) and
`decode_attention` here answers it: the same contract and the same numbers (fp32 throughout) as
`qcache.kernels.decode_attention`, but each packed byte of the quantized region is read once, in cache-sized tiles,
with nothing written back to memory but the partial sums of each chunk of tokens:

- keys: unpacked, dequantized with their block's per-channel scale and zero, un-rotated with a Walsh-Hadamard
  butterfly (D log D operations per token instead of the D x D product of `x @ R.T`), RoPE re-applied by angle
  addition, scored against the G query rows of their kv head;
- values: unpacked and weighted into a per-chunk online softmax (running max, sum, weighted sum in rotated space);
- the chunks, the full-precision sinks and window, and the values' un-rotation (once, on the [B, H, G, D] output)
  are combined here with a few small torch operations.

The C source is compiled once per machine with the system C compiler (`$CC`, else `cc`) at `-O3 -march=native
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

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .codec import KeyCodec, ValueCodec

__all__ = ["available", "unsupported", "decode_attention", "library_path"]

_SOURCE = Path(__file__).with_name("csrc") / "decode.c"
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
    key = _SOURCE.read_bytes() + " ".join([_compiler(), *_FLAGS, _cpu()]).encode()
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
        proc = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
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
                i, i64, f, p = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
                fn.argtypes = ([i] * 13 + [f] + [p, i64, i64, i64] + [p] * 7 + [p, i64, i64, i64] + [p] * 3
                               + [p, p, i64] + [p] * 3)
                fn.restype = ctypes.c_int
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


def _levels(codec, consts: dict, qmax_units: bool, uniform_none: bool = False) -> torch.Tensor | None:
    """The level of each code (in units of a step with `qmax_units`, as `quant.dequantize` reads a codebook);
    uniform levels are the codes themselves: None with `uniform_none` (the kernel then converts the code)."""
    if not codec.codebook:
        return None if uniform_none else torch.arange(2**codec.bits, dtype=torch.float32)
    cb = consts["codebook"].float().cpu()
    return (cb * (cb.numel() - 1) if qmax_units else cb).contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decode_attention(query: torch.Tensor, fp_k: torch.Tensor, fp_v: torch.Tensor, bias: torch.Tensor | None, q,
                     n_sink: int, scaling: float, k_codec: KeyCodec, v_codec: ValueCodec) -> torch.Tensor:
    """`qcache.kernels.decode_attention` (same arguments, same result) computed by the C kernel on CPU tensors."""
    B, H, G, D = query.shape
    reason = unsupported(k_codec, v_codec, D, G, q.k_consts)
    if reason is not None:
        raise ValueError(f"kernel='native' cannot read this layer's codes ({reason}); allowed there: kernel='compiled' "
                         "or kernel='eager'")
    if query.device.type != "cpu":
        raise ValueError(f"kernel='native' runs on CPU tensors; got {query.device}")
    lib = _load()
    kc = q.k[k_codec.prefix + "codes"]
    T = kc.shape[2]
    S = n_sink
    scale, zero = q.k[k_codec.prefix + "scale"].float(), q.k[k_codec.prefix + "zero"].float()  # [B, H, nb, D]
    rot_block = 0
    if k_codec.rotation:
        fold, rot_block = _hadamard_fold(q.k_consts["rotation"])
        scale, zero = scale * fold, zero * fold
    scale, zero = scale.contiguous(), zero.contiguous()
    klev = _levels(k_codec, q.k_consts, True, uniform_none=True)
    bcos = bsin = ocos = osin = None
    rh = 0
    if q.rope is not None:
        block_cos, block_sin, off_cos, off_sin = q.rope
        rh = block_cos.shape[-1]
        if off_cos.shape[0] != k_codec.group:
            raise ValueError(f"RoPE offset table of {off_cos.shape[0]} rows for key blocks of {k_codec.group} tokens")
        bcos, bsin = block_cos.float().contiguous(), block_sin.float().contiguous()
        if bcos.shape[0] != B:
            bcos, bsin = bcos.expand(B, -1, -1).contiguous(), bsin.expand(B, -1, -1).contiguous()
        ocos, osin = off_cos.float().t().contiguous(), off_sin.float().t().contiguous()
    vc = q.v[v_codec.prefix + "codes"]
    vscale = q.v[v_codec.prefix + "scale"].float().contiguous()  # [B, H, T, groups]
    vzero = None if v_codec.norm else q.v[v_codec.prefix + "zero"].float().contiguous()
    vlev = _levels(v_codec, q.v_consts, not v_codec.norm)
    qry = query.float().contiguous()
    region_bias = None
    if bias is not None:
        region_bias = bias.reshape(bias.shape[0], bias.shape[-1])[:, S:S + T].float().expand(B, T).contiguous()
    NC = -(-T // _CHUNK)
    out_m = torch.empty(B, H, NC, G)
    out_l = torch.empty(B, H, NC, G)
    out_acc = torch.empty(B, H, NC, G, D)
    for name, t in (("key codes", kc), ("value codes", vc)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} with last stride {t.stride(-1)}; the kernel reads rows of bytes")
    rc = lib.qcache_decode_attention(
        B, H, G, D, T, k_codec.group, k_codec.bits, v_codec.bits, v_codec.group, rot_block, rh, _CHUNK,
        torch.get_num_threads(), float(scaling),
        kc.data_ptr(), kc.stride(0), kc.stride(1), kc.stride(2), scale.data_ptr(), zero.data_ptr(), _ptr(klev),
        _ptr(bcos), _ptr(bsin), _ptr(ocos), _ptr(osin),
        vc.data_ptr(), vc.stride(0), vc.stride(1), vc.stride(2), vscale.data_ptr(), _ptr(vzero), vlev.data_ptr(),
        qry.data_ptr(), _ptr(region_bias), T, out_m.data_ptr(), out_l.data_ptr(), out_acc.data_ptr())
    if rc:
        raise ValueError(f"qcache's C decode kernel refused its arguments (code {rc}): T={T}, block {k_codec.group}")
    # combine the chunks with the full-precision tokens [sinks | window]
    s_fp = (qry @ fp_k.float().transpose(-1, -2)) * scaling  # [B, H, G, S + R]
    if bias is not None:
        b = bias.reshape(bias.shape[0], bias.shape[-1]).float()
        s_fp = s_fp + torch.cat([b[:, :S], b[:, S + T:]], dim=-1)[:, None, None, :]
    m_c = out_m.transpose(2, 3)  # [B, H, G, NC]
    top = torch.maximum(s_fp.amax(-1, keepdim=True), m_c.amax(-1, keepdim=True))  # [B, H, G, 1]
    p_fp = torch.exp(s_fp - top)
    w = torch.exp(m_c - top)  # [B, H, G, NC]
    denom = p_fp.sum(-1, keepdim=True) + (w * out_l.transpose(2, 3)).sum(-1, keepdim=True)
    region = torch.einsum("bhgc,bhcgd->bhgd", w, out_acc)
    num = v_codec.unrotate(region, q.v_consts) + p_fp @ fp_v.float()
    return num / denom
