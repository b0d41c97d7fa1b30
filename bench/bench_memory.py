"""Bytes held: every tensor reachable from a cache filled to a long context, vs the default cache filled the same way.

    python bench/bench_memory.py            # SmolLM2-135M at 8192 and Gemma-3-270M at 32768 -> docs/results/memory.*

Each cache is built for the model's config and filled through `Cache.update`, layer by layer, in chunks of 1024
tokens at consecutive positions, with the same random bf16 key/value states for every cache (the bytes a cache holds
depend on the geometry and the token count, not on the values; no model forward is needed). Bytes are counted by
`qcache.tools.footprint.reachable_bytes` (every tensor storage reachable from the cache object, each once: codes, scales,
outliers, full-precision tokens, positions, RoPE tables or anything else it keeps) and, for QuantCache, compared with
what its own `memory()` reports. Bits/value held = bytes x 8 / the K and V values the default cache holds (sliding
layers count their window), so the default cache is 16.0. Not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qcache import QuantCache, __version__
from eval.caches import build_cache
from qcache.tools.footprint import reachable_bytes
from qcache.tools.models import load_model

DEFAULT_RUNS = {"smollm2-135m": 8192, "gemma3-270m": 32768}
CACHES = ("default", "quant:8", "quant:4", "quant:3", "quant:2", "hf-quanto:4", "hf-hqq:4", "hf-fp8")


def _git() -> dict:
    def run(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    return {"commit": run("git", "rev-parse", "HEAD"), "clean": run("git", "status", "--porcelain") == ""}


def fill(cache, text_config, tokens: int, chunk: int = 1024, seed: int = 0) -> None:
    """Feed `tokens` random bf16 K/V states through every layer of `cache`, `chunk` tokens at a time."""
    H = text_config.num_key_value_heads
    D = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    g = torch.Generator().manual_seed(seed)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        pos = torch.arange(start, start + n)[None]
        for layer in range(text_config.num_hidden_layers):
            k = torch.randn(1, H, n, D, generator=g).to(torch.bfloat16)
            v = torch.randn(1, H, n, D, generator=g).to(torch.bfloat16)
            cache.update(k, v, layer, kwargs={"position_ids": pos}, cache_kwargs={"position_ids": pos})


def measure(model_name: str, tokens: int, caches: list[str]) -> list[dict]:
    model, _ = load_model(model_name, dtype=torch.bfloat16)
    config = model.config
    text = config.get_text_config(decoder=True)
    del model
    rows, default_bytes = [], None
    for spec in tqdm(caches, desc=f"{model_name} caches", leave=False):
        kind, _, bits = spec.partition(":")
        row = {"model": model_name, "tokens": tokens, "cache": spec}
        try:
            cache = build_cache(kind, config, int(bits) if bits else None)
            fill(cache, text, tokens)
        except (ValueError, ImportError, NotImplementedError) as err:
            row["error"] = f"{type(err).__name__}: {err}"
            rows.append(row)
            continue
        held = reachable_bytes(cache)
        row["reachable_bytes"] = held
        if isinstance(cache, QuantCache):
            mem = cache.memory()
            row["memory_total"] = mem.total
            row["memory"] = {k: v for k, v in vars(mem).items()}
        if kind == "default":
            default_bytes = held
        rows.append(row)
        del cache
    for row in rows:
        if "reachable_bytes" in row and default_bytes:
            row["ratio_to_default"] = row["reachable_bytes"] / default_bytes
            row["bits_per_value_held"] = 16 * row["reachable_bytes"] / default_bytes
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_RUNS), choices=sorted(DEFAULT_RUNS),
                        help="short model names; each is filled to its maximum context")
    parser.add_argument("--caches", nargs="+", default=list(CACHES), help="cache specs KIND[:BITS]")
    parser.add_argument("--out", default="docs/results/memory", help="output path without extension")
    args = parser.parse_args(argv)
    rows = []
    for name in args.models:
        rows += measure(name, DEFAULT_RUNS[name], args.caches)
    report = {"command": " ".join(["python", "bench/bench_memory.py", *sys.argv[1:]]), "git": _git(),
              "qcache_version": __version__, "torch": torch.__version__, "machine": platform.platform(),
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=2))
    lines = ["# Bytes held at the model's full context", "",
             f"`{report['command']}` at {report['git']['commit'][:10]}"
             f"{'' if report['git']['clean'] else ' (uncommitted changes)'}. Caches filled through `Cache.update` "
             "with bf16 states at consecutive positions; bytes = every tensor storage reachable from the cache "
             "(`qcache.tools.footprint`); bits/value held = 16 x bytes / the default cache's bytes.", "",
             "| model | tokens | cache | MB held | x default | bits/value held | `memory().total` MB |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['tokens']} | {r['cache']} | refused: {r['error'][:90]} | | | |")
            continue
        mem = f"{r['memory_total'] / 1e6:.2f}" if "memory_total" in r else ""
        lines.append(f"| {r['model']} | {r['tokens']} | {r['cache']} | {r['reachable_bytes'] / 1e6:.2f} | "
                     f"{r['ratio_to_default']:.3f} | {r['bits_per_value_held']:.2f} | {mem} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
