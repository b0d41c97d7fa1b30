"""Which QuantCache defaults? Chunked perplexity (the input fed through the cache 256 tokens at a time) of option variants vs the default cache, same run.

    python bench/ablate_defaults.py --bits 4 --variants k_group_size=32 v_group_size=32 recent_tokens=128
    python bench/ablate_defaults.py --bits 2 --variants "k_group_size=32,v_group_size=32" --out docs/results/defaults-2bit

Each variant is a comma-separated list of QuantCacheConfig fields; "base" is the current defaults. Also prints the
bytes per token each variant holds at --context tokens (from QuantCacheConfig.bytes_per_token, which
tests/test_cache.py checks against the tensors held), so quality is read next to its cost.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qcache import QuantCache, QuantCacheConfig
from qcache.tools.data import token_sequences
from qcache.tools.models import load_model
from eval.perplexity import chunked_nll

log = logging.getLogger("ablate_defaults")


def parse_variant(text: str) -> dict:
    if text == "base":
        return {}
    out = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key in ("rope", "sliding_layers", "scale_dtype"):
            out[key] = value
        elif key in ("clip_search", "codebooks", "static_keys"):
            out[key] = value.lower() in ("1", "true", "yes")
        else:
            out[key] = int(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="short name or HF directory")
    p.add_argument("--bits", type=int, default=4, choices=[2, 3, 4, 8], help="bits for K and V")
    p.add_argument("--variants", nargs="+", default=["base"], help='e.g. base "k_group_size=32,recent_tokens=128"')
    p.add_argument("--num-seqs", type=int, default=4, help="sequences of eval text")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward")
    p.add_argument("--context", type=int, default=8192, help="context for the bytes/token column")
    p.add_argument("--out", default=None, help="write .json/.md here (path without extension)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    model, tok = load_model(args.model, dtype=torch.float32)
    c = model.config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    ids = token_sequences(tok, "eval", args.num_seqs, args.seq_len)
    nll, n = chunked_nll(model, ids, lambda: __import__("transformers").DynamicCache(config=model.config),
                         chunk=args.chunk)
    base_ppl = math.exp(nll / n)
    rows = []
    for text in tqdm(args.variants, desc="variants"):
        opts = {"k_bits": args.bits, "v_bits": args.bits, **parse_variant(text)}
        cfg = QuantCacheConfig(**opts)
        t0 = time.perf_counter()
        nll, n = chunked_nll(model, ids, lambda: QuantCache(model.config, options=cfg), chunk=args.chunk)
        ppl = math.exp(nll / n)
        bpt = cfg.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, head_dim, args.context)
        fp16 = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2
        rows.append({"variant": text, "options": cfg.to_dict(), "ppl": ppl, "delta_pct": 100 * (ppl / base_ppl - 1),
                     "ratio_vs_16bit": bpt / fp16, "seconds": time.perf_counter() - t0})
        log.info("%s: ppl %.4f (%+.2f %%), %.4fx of 16-bit", text, ppl, rows[-1]["delta_pct"], bpt / fp16)
    lines = [f"# Defaults ablation: {args.model}, {args.bits} bits", "",
             f"Command: `python bench/ablate_defaults.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
             f"Default cache PPL {base_ppl:.4f} ({args.num_seqs} x {args.seq_len} eval tokens, chunks of {args.chunk})",
             "", f"| variant | PPL | vs default | bytes vs 16-bit @ {args.context} |", "|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['ppl']:.4f} | {r['delta_pct']:+.2f} % | {r['ratio_vs_16bit']:.4f}x |"
              for r in rows]
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "default_ppl": base_ppl,
                                                        "rows": rows}, indent=2) + "\n")
        out.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
