"""A short demo: generate with SmolLM2 through `QuantCache(bits=4)` and the default cache; print both answers and the
bytes each cache holds (counted from its tensors).

    python -m qcache.demo [--model smollm2-135m] [--bits 4] [--context-chars 6000]
"""

from __future__ import annotations

import argparse
import time

import torch

from ..cache import QuantCache
from ..config import SUPPORTED_BITS
from .data import read_split
from .models import load_model


def dynamic_cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m qcache.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="short name or local HF directory")
    p.add_argument("--bits", type=int, default=4, choices=SUPPORTED_BITS, help="QuantCache bits for K and V")
    p.add_argument("--context-chars", type=int, default=6000, help="characters of prose put before the question")
    p.add_argument("--max-new-tokens", type=int, default=12, help="tokens to generate")
    args = p.parse_args(argv)

    from transformers import DynamicCache

    model, tok = load_model(args.model, dtype=torch.bfloat16)
    prompt = read_split("eval")[: args.context_chars] + "\n\nThe capital of France is"
    inputs = tok(prompt, return_tensors="pt")
    n_prompt = inputs["input_ids"].shape[1]
    print(f"model {args.model} (bf16), prompt of {n_prompt} tokens (prose, then 'The capital of France is')\n")
    rows = []
    for name, cache in [("default (DynamicCache)", DynamicCache(config=model.config)),
                        (f"QuantCache(bits={args.bits})", QuantCache(bits=args.bits))]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, cache=cache, max_new_tokens=args.max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - t0
        text = tok.decode(out[0, n_prompt:], skip_special_tokens=True)
        held = cache.memory().total if isinstance(cache, QuantCache) else dynamic_cache_bytes(cache)
        tokens = cache.get_seq_length()
        rows.append((name, held, tokens))
        print(f"{name:24s} answer: {text.strip()!r}  ({seconds:.1f} s)")
    print()
    base = rows[0][1]
    for name, held, tokens in rows:
        print(f"{name:24s} holds {held / 2**20:7.2f} MiB for {tokens} tokens = {held / tokens:8.1f} B/token "
              f"({held / base:.3f}x default)")
    if isinstance(cache, QuantCache):
        m = cache.memory()
        print(f"\nQuantCache split: packed {m.packed / 2**20:.2f} MiB, scales/zeros {m.scales / 2**20:.2f} MiB, "
              f"full-precision tokens {m.full_precision / 2**20:.2f} MiB, positions {m.positions / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
