"""How close the CPU decode kernel (qcache/native.py) comes to the bytes it reads: one layer's decode attention from
the packed codes, timed alone, against a memcpy-like copy measured on the same machine in the same run.

    python bench/decode_roofline.py --out docs/results/decode-roofline     # ~1 minute

For each geometry (SmolLM2-135M: 3 kv heads x 64, 9 query heads; Qwen2.5-Coder-1.5B: 2 x 128, 12 query heads) and
context, one layer of QuantCache(bits=4) (rotated keys, the defaults otherwise) is filled with random bf16 states,
and the time of `native.decode_attention` (the C call and the torch that prepares its pointers) and of the C call
alone is the median of repeats, with the 8-bit window handed over as its codes (what `QuantCache(bits=4)` decodes
with). Bytes read: every tensor the kernel reads (the quantized region's codes, block scales and zeros, value
scales; the window's codes, scales and zeros; the sinks). The roofline is the bandwidth of `torch.Tensor.copy_`
between two buffers of 512 MiB (read + write bytes / time), with the same thread count. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, Qwen2Config

from eval.fidelity import describe_machine
from qcache import QuantCache, native

GEOMETRIES = {
    "smollm2-135m": lambda: LlamaConfig(head_dim=64, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                        num_hidden_layers=1, vocab_size=128, intermediate_size=64),
    "qwen2.5-coder-1.5b": lambda: Qwen2Config(head_dim=128, hidden_size=1536, num_attention_heads=12,
                                              num_key_value_heads=2, num_hidden_layers=1, vocab_size=128,
                                              intermediate_size=64),
}


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def copy_bandwidth(mib: int, repeats: int) -> float:
    """GB/s of a buffer-to-buffer copy (bytes read + bytes written per second)."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * 4 / (ms / 1e3) / 1e9


def layer_case(name: str, context: int, repeats: int) -> dict:
    config = GEOMETRIES[name]()
    cache = QuantCache(config, bits=4, kernel="native", rotate="kv")
    H, D = config.num_key_value_heads, config.head_dim
    G = config.num_attention_heads // H
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, H, context, D, generator=g).to(torch.bfloat16) for _ in range(2))
    cache.update(k, v, 0, kwargs={"position_ids": torch.arange(context)[None]})
    one = [torch.randn(1, H, 1, D, generator=g).to(torch.bfloat16) for _ in range(2)]
    keys, _ = cache.update(*one, 0, kwargs={"position_ids": torch.tensor([[context]])})
    layer, step = cache.layers[0], keys.step
    if step.window is None:
        raise RuntimeError("the decode step did not hand over the 8-bit window as its codes")
    q = layer._quantized()
    query = torch.randn(1, H, G, D, generator=g)
    fp_k, fp_v = step._fp  # the sinks; the window is read from its codes (step.window), as the literal line does
    args = (query, fp_k, fp_v, None, q, layer.store.length("sink"), D**-0.5, layer.k_codec, layer.v_codec)
    held = [*q.k.values(), *q.v.values(), *step.window.k.values(), *step.window.v.values(), fp_k, fp_v]
    read = sum(t.numel() * t.element_size() for t in held)
    total_ms = _median_ms(lambda: native.decode_attention(*args, window=step.window), repeats)
    lib = native._load()
    real = lib.qcache_decode_attention
    timed = {}

    def timing(*a):  # the C call alone, timed while the tensors its pointers name are alive
        timed["ms"] = _median_ms(lambda: real(*a), repeats)
        return real(*a)

    lib.qcache_decode_attention = timing
    try:
        native.decode_attention(*args, window=step.window)
    finally:
        lib.qcache_decode_attention = real
    c_ms = timed["ms"]
    return {"geometry": name, "context": context, "kv_heads": H, "head_dim": D, "query_rows": G,
            "quantized_tokens": layer.quantized_length, "bytes_read": read, "c_ms": c_ms, "total_ms": total_ms,
            "c_gb_s": read / (c_ms / 1e3) / 1e9, "total_gb_s": read / (total_ms / 1e3) / 1e9}


def to_markdown(result: dict) -> str:
    lines = ["# CPU decode kernel against its bytes", "", f"Command: `{result['command']}`  ",
             f"Date: {result['date']}; {result['machine']}  ",
             f"qcache git {result['git']}, torch {result['torch']}", "",
             f"Roofline: a {result['copy_mib']} MiB buffer copy moves **{result['copy_gb_s']:.1f} GB/s** (read + "
             "write). One layer of QuantCache(bits=4), rotated keys, one decode query, the 8-bit window read from "
             "its codes; bytes read = the quantized region's codes and scales, the window's codes and scales, the "
             "sinks; 'C' is the kernel call alone, 'all' adds the torch that prepares its arguments.", "",
             "| geometry | context | kv heads x head_dim | bytes read | C ms | C GB/s | C / copy | all ms | all GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['geometry']} | {r['context']} | {r['kv_heads']} x {r['head_dim']} | {r['bytes_read']:,} | "
                     f"{r['c_ms']:.2f} | {r['c_gb_s']:.2f} | {r['c_gb_s'] / result['copy_gb_s']:.0%} | "
                     f"{r['total_ms']:.2f} | {r['total_gb_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--geometries", nargs="*", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--copy-mib", type=int, default=512)
    p.add_argument("--out", default="docs/results/decode-roofline", help="path without extension (.json and .md)")
    args = p.parse_args(argv)
    if not native.available():
        raise SystemExit("qcache's C decode kernel does not build here (a C compiler with OpenMP is needed)")
    torch.set_num_threads(args.threads)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    result = {"command": "python bench/decode_roofline.py " + " ".join(argv or __import__("sys").argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": describe_machine(), "threads": args.threads,
              "git": git + ("-dirty" if dirty else ""), "torch": torch.__version__, "copy_mib": args.copy_mib,
              "copy_gb_s": copy_bandwidth(args.copy_mib, args.repeats), "rows": []}
    cases = [(g, L) for g in args.geometries for L in args.contexts]
    for g, L in tqdm(cases, desc="layers"):
        result["rows"].append(layer_case(g, L, args.repeats))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(str(out) + ".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(str(out) + ".md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
