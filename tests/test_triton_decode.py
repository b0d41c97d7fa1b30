"""qcache/triton_decode.py: the Triton decode attention from the packed codes gives `qcache.kernels.decode_attention`'s
fp32 result on real cache layers (bits 4, 3, 2 and 8, rotated or not, norm or min-max values, head_dim 64, 96, 128,
with and without a padding mask, partial rotary and no RoPE), and refuses by name what it does not read.

On CPU the kernels run in Triton's interpreter, which reads TRITON_INTERPRET=1 when they are defined: the cases run
in one subprocess with it set (this file run as a script prints their errors as JSON), so no setting leaks into the
rest of the suite. The CUDA test runs the compiled kernels against the reference where a GPU is present."""

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable (pip install triton; Linux only)")
RTOL, ATOL = 1e-4, 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
    """One cache layer to attend over: its recipe and how the query side is shaped."""

    bits: int
    head_dim: int = 64
    groups: int = 2  # query heads per kv head
    rotate: str = "kv"
    options: tuple = ()  # more QuantCache options, as (name, value) pairs
    mask: bool = True  # row 1 left-padded: its first tokens hidden by the bias
    rope: str = "full"  # "full", "partial" (factors of the first 16 pairs only) or "none"
    chunk: int | None = 64

    @property
    def name(self) -> str:
        opts = "".join(f"-{k}={v}" for k, v in self.options)
        mask = "mask" if self.mask else "nomask"
        return (f"k{self.bits}-d{self.head_dim}-g{self.groups}-rot{self.rotate}{opts}-{mask}-rope{self.rope}"
                f"-chunk{self.chunk}")


CASES = [
    Case(4, groups=3),                                       # QuantCache(bits=4)'s recipe, rotated keys
    Case(4, groups=3, mask=False, chunk=None),               # one chunk per head (sized to the device)
    Case(3),                                                 # QuantCache(bits=3)
    Case(2, mask=False),                                     # QuantCache(bits=2): lloyd-max key levels
    Case(2),
    Case(4, head_dim=128),
    Case(3, head_dim=96, mask=False),                        # not a power of two: padded, masked tiles
    Case(4, rotate="v", chunk=32),                           # keys unrotated, values rotated (norm)
    Case(3, options=(("rotation", "none"), ("v_scale", "minmax"))),  # unrotated min-max values, uniform levels
    Case(2, options=(("rotation", "none"), ("v_scale", "minmax"))),  # ... on lloyd-max levels (keys and values)
    Case(8, options=(("window_bits", 16),)),                 # QuantCache(bits=8)'s widths
    Case(4, groups=3, rope="partial"),
    Case(4, rope="none", chunk=96),
]


def build(case: Case, device="cpu"):
    """(reference arguments, quantized tokens) of `case`: layer 0 of a QuantCache fed a 230-token prefill and one
    decode token (192 quantized tokens: 6 key blocks), its quantized region (`_quantized`), the step's
    full-precision [sinks | residual] states and a random fp32 query [B, H, G, D]."""
    from transformers import LlamaConfig

    from qcache import QuantCache

    H, D, B = 2, case.head_dim, 2
    config = LlamaConfig(vocab_size=96, hidden_size=H * case.groups * D, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=H * case.groups, num_key_value_heads=H, head_dim=D,
                         max_position_embeddings=1024)
    cache = QuantCache(config, bits=case.bits, kernel="eager", k_group_size=32, recent_tokens=16, sink_tokens=4,
                       rotate=case.rotate, **dict(case.options))
    g = torch.Generator().manual_seed(case.bits * 1000 + D + case.groups)
    pad = 40 if case.mask else 0  # row 1's first 40 tokens are padding (the sinks and more than a chunk)
    pos = 0
    for n in (230, 1):
        k, v = (torch.randn(B, H, n, D, generator=g).to(torch.bfloat16) for _ in range(2))
        p = torch.arange(pos, pos + n)[None].repeat(B, 1)
        p[1] -= pad
        cache.update(k.to(device), v.to(device), 0, kwargs={"position_ids": p.clamp(min=0).to(device)})
        pos += n
    layer = cache.layers[0]
    s = layer.store
    q = layer._quantized()
    if case.rope == "partial":  # RoPE on the first 2 x 16 channels only, the rest passed through
        q = q._replace(rope=tuple(t[..., :16] for t in q.rope))
    elif case.rope == "none":
        q = q._replace(rope=None)
    res_k, res_v = layer._window()
    fp_k, fp_v = torch.cat([s.view("sink_k"), res_k], dim=2), torch.cat([s.view("sink_v"), res_v], dim=2)
    S, T = s.length("sink"), s.length("token")
    N = fp_k.shape[2] + T
    bias = None
    if case.mask:
        bias = torch.zeros(B, 1, 1, N, device=device)
        bias[1, ..., :pad] = torch.finfo(torch.float32).min
    query = torch.randn(B, H, case.groups, D, generator=g).to(device)
    return (query, fp_k, fp_v, bias, q, S, D**-0.5, layer.k_codec, layer.v_codec), T


def compare(case: Case, device="cpu") -> dict:
    """The Triton result against the reference: largest errors, and what the region held."""
    from qcache import kernels, triton_decode

    args, T = build(case, device)
    ref = kernels.decode_attention(*args)
    got = triton_decode.decode_attention(*args, chunk=case.chunk)
    ok = torch.allclose(got, ref, rtol=RTOL, atol=ATOL)
    err = (got - ref).abs()
    return {"ok": ok, "max_abs": float(err.max()), "max_rel": float((err / ref.abs().clamp_min(1e-6)).max()),
            "tokens": T, "shape": list(got.shape), "finite": bool(got.isfinite().all()),
            "k_codec": str(args[7]), "v_codec": str(args[8])}


def _worker() -> None:
    """Script mode (TRITON_INTERPRET=1 set by the caller): every case's comparison, one JSON line each."""
    torch.set_num_threads(1)
    for case in CASES:
        try:
            out = compare(case)
        except Exception as err:  # reported to the test, which fails naming it  # noqa: BLE001
            out = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        print(json.dumps({"case": case.name, **out}), flush=True)


@pytest.fixture(scope="module")
def interpreted():
    """Run every case once in a subprocess under Triton's interpreter: {case name: result}."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "QCACHE_KERNEL": "eager",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row.pop("case")] = row
    return results


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interpreted_kernel_equals_reference(case, interpreted):
    row = interpreted.get(case.name)
    assert row is not None, f"no result for {case.name}: {sorted(interpreted)}"
    assert "error" not in row, row["error"]
    assert row["tokens"] == 192 and row["finite"], row  # several key blocks were quantized
    assert row["ok"], f"{case.name}: max abs error {row['max_abs']:.3g}, max rel {row['max_rel']:.3g} ({row})"


def test_import_does_not_define_kernels():
    """Importing the module neither defines the kernels nor needs triton: without it, `unsupported` says so."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from qcache import triton_decode as t\n"
            "assert not t._KERNELS\n"
            "from qcache.codec import KeyCodec, ValueCodec\n"
            "import torch\n"
            "print(t.unsupported(KeyCodec(4, 32, torch.float16), ValueCodec(4, 64, torch.float16), None))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("triton is not importable"), proc.stdout


@needs_triton
def test_unsupported_names_the_reason():
    """Outliers, static key ranges, wide rotated heads, CPU tensors outside the interpreter are refused by name,
    and decode_attention raises ValueError with that reason instead of computing something else."""
    from qcache import triton_decode
    from qcache.codec import ValueCodec

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: CPU tensors are served")
    args, _ = build(Case(4, mask=False))
    q, k_codec, v_codec = args[4], args[7], args[8]
    if not triton_decode._kernels()["interpreted"]:
        reason = triton_decode.unsupported(k_codec, v_codec, q)
        assert reason is not None and "CUDA" in reason and "TRITON_INTERPRET=1" in reason
        with pytest.raises(ValueError, match="cannot read this layer's codes: tensors on cpu"):
            triton_decode.decode_attention(*args)
    refused = {
        "outliers": (dataclasses.replace(k_codec, outliers=1), v_codec),
        "static key ranges": (dataclasses.replace(k_codec, static=True), v_codec),
    }
    minmax = ValueCodec(bits=4, group=16, scale_dtype=torch.float16, outliers=1)  # (norm values take no outliers)
    refused["outliers (keys 0, values 1"] = (k_codec, minmax)
    for expected, (kc, vc) in refused.items():
        reason = triton_decode.unsupported(kc, vc, q)
        assert reason is not None and reason.startswith(expected), (expected, reason)
        with pytest.raises(ValueError, match=re.escape(f"cannot read this layer's codes: {reason}")):
            triton_decode.decode_attention(*args[:7], kc, vc)
    wide = q._replace(k={**q.k, "k_scale": q.k["k_scale"].new_zeros(2, 2, 8, 256)})  # head_dim 256, rotated keys
    assert "head_dim 256 with rotated keys" in triton_decode.unsupported(k_codec, v_codec, wide)


@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled Triton kernels)")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cuda_kernel_equals_reference(case):
    row = compare(case, device="cuda")
    assert row["ok"], f"{case.name}: max abs error {row['max_abs']:.3g}, max rel {row['max_rel']:.3g} ({row})"


if __name__ == "__main__":
    _worker()
