"""Core benchmark (issue: QuantCache core): bytes held per token at 8k context, and chunked perplexity vs the default
cache and Transformers' quantized caches, measured in the same run.

    python bench/bench_core.py                       # SmolLM2-135M, writes docs/results/core.{json,md}
    python bench/bench_core.py --model gemma3-270m --out docs/results/core-gemma3

Not a test: it takes minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qcache import QuantCache, __version__
from eval.caches import build_cache, cache_label
from qcache.tools.data import sha256_of_split, token_sequences
from qcache.tools.models import load_model
from eval.perplexity import chunked_nll

log = logging.getLogger("bench_core")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def geometry(config) -> tuple[int, int, int]:
    c = config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, c.num_key_value_heads, head_dim


def measure_memory(name: str, bits_list: list[int], context: int, chunk: int) -> list[dict]:
    """Fill a QuantCache (default settings) with `context` tokens of eval text in bf16; count its tensors."""
    model, tok = load_model(name, dtype=torch.bfloat16)
    layers, heads, head_dim = geometry(model.config)
    fp16_bytes = 2 * layers * heads * head_dim * 2 * context  # K and V, 2 bytes/value
    ids = token_sequences(tok, "eval", 1, context)
    rows = []
    for bits in bits_list:
        cache = QuantCache(model.config, bits=bits)
        with torch.no_grad():
            for start in tqdm(range(0, context, chunk), desc=f"fill {bits}-bit", leave=False):
                model(ids[:, start:start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
        mem = cache.memory()
        assert mem.tokens == context, (mem.tokens, context)
        rows.append({
            "bits": bits, "context": context, "bytes_per_token": mem.total / context,
            "fp16_bytes_per_token": fp16_bytes / context, "ratio_vs_16bit": mem.total / fp16_bytes,
            "packed": mem.packed, "scales": mem.scales, "full_precision": mem.full_precision,
            "positions": mem.positions, "options": cache.options.to_dict(),
        })
        log.info("%d-bit: %.4fx of 16-bit", bits, mem.total / fp16_bytes)
    return rows


def measure_perplexity(name: str, specs: list[tuple[str, int | None]], num_seqs: int, seq_len: int, chunk: int,
                       dtype: torch.dtype, done: list[dict], save) -> list[dict]:
    """Rows already in `done` (same settings, from an interrupted run) are kept; `save(rows)` after each row."""
    model, tok = load_model(name, dtype=dtype)
    ids = token_sequences(tok, "eval", num_seqs, seq_len)
    rows = []
    for kind, bits in tqdm(specs, desc="caches"):
        label = cache_label(kind, bits)
        previous = next((r for r in done if r["cache"] == label and "ppl" in r), None)
        if previous is not None:
            rows.append(previous)
            continue
        try:
            make = lambda: build_cache(kind, model.config, bits)  # noqa: E731
            make()
        except (ValueError, ImportError) as err:  # e.g. Transformers' caches reject sliding-window layers
            rows.append({"cache": label, "kind": kind, "bits": bits, "error": str(err)})
            log.warning("%s: %s", label, err)
            continue
        t0 = time.perf_counter()
        nll, count = chunked_nll(model, ids, make, chunk=chunk, progress=True, desc=label)
        rows.append({"cache": label, "kind": kind, "bits": bits, "nll_sum": nll, "tokens": count,
                     "ppl": float(torch.tensor(nll / count).exp()), "seconds": time.perf_counter() - t0})
        log.info("%s: ppl %.4f", label, rows[-1]["ppl"])
        save(rows)
    return rows


def to_markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Core benchmark: {a['model']}", "",
             f"Command: `{result['command']}`  ",
             *(f"Resumed from (rows kept): `{c}`  " for c in result.get("earlier_commands", [])), f"Date: {result['date']}; machine: {result['machine']}; "
             f"qcache {result['qcache_version']}, torch {result['torch']}, transformers {result['transformers']}", ""]
    if result.get("memory"):
        lines += [f"## Bytes held per token at {a['context']} tokens (bf16 model, default settings)", "",
                  "| bits | bytes/token | 16-bit bytes/token | ratio | packed | scales | full precision | positions |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["memory"]:
            lines.append(f"| {r['bits']} | {r['bytes_per_token']:.1f} | {r['fp16_bytes_per_token']:.0f} | "
                         f"**{r['ratio_vs_16bit']:.4f}x** | {r['packed']} | {r['scales']} | {r['full_precision']} | "
                         f"{r['positions']} |")
        lines.append("")
    if result.get("perplexity"):
        lines += [f"## Chunked perplexity ({a['num_seqs']} x {a['seq_len']} tokens of eval text, chunks of "
                  f"{a['chunk']}, {a['dtype']})", "",
                  "| cache | PPL | vs default | seconds |", "|---|---:|---:|---:|"]
        for r in result["perplexity"]:
            if "error" in r:
                lines.append(f"| {r['cache']} | n/a | {r['error']} | |")
            else:
                delta = f"{r['delta_pct']:+.2f} %" if "delta_pct" in r else "n/a (no default row)"
                lines.append(f"| {r['cache']} | {r['ppl']:.4f} | {delta} | {r['seconds']:.0f} |")
        lines.append("")
    if result.get("notes"):
        lines += [f"Note: {result['notes']}", ""]
    return "\n".join(lines)


def parse_specs(items: list[str]) -> list[tuple[str, int | None]]:
    specs = []
    for item in items:
        kind, _, bits = item.partition(":")
        specs.append((kind, int(bits) if bits else None))
    return specs


DEFAULT_SPECS = ["default", "quant:8", "quant:4", "quant:3", "quant:2", "hf-quanto:4", "hf-quanto:2", "hf-hqq:4",
                 "hf-hqq:2", "hf-fp8"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="short name, HF directory or hub id")
    p.add_argument("--out", default="docs/results/core", help="output path without extension (.json and .md)")
    p.add_argument("--context", type=int, default=8192, help="tokens held when counting bytes")
    p.add_argument("--mem-bits", type=int, nargs="*", default=[8, 4, 3, 2], help="bit widths for the memory table")
    p.add_argument("--caches", nargs="*", default=DEFAULT_SPECS, help="kind[:bits] rows of the perplexity table")
    p.add_argument("--num-seqs", type=int, default=4, help="sequences of eval text")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--chunk", type=int, default=256, help="tokens fed per forward")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype for perplexity")
    p.add_argument("--resume", action="store_true",
                   help="keep rows (and, with --mem-bits given empty, the memory table) of an earlier run of the "
                        "same settings found in --out, and measure only the missing ones")
    p.add_argument("--render", action="store_true", help="only rewrite --out's .md from its .json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(0)
    if args.render:
        result = json.loads(Path(args.out).with_suffix(".json").read_text())
        base = next((r["ppl"] for r in result["perplexity"] if r["kind"] == "default"), None)
        for r in result["perplexity"]:
            if "ppl" in r and base:
                r["delta_pct"] = 100.0 * (r["ppl"] / base - 1.0)
        Path(args.out).with_suffix(".md").write_text(to_markdown(result) + "\n")
        print(to_markdown(result))
        return 0

    import transformers

    result = {
        "command": " ".join(["python", "bench/bench_core.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, CPU (shared; times are noise)",
        "qcache_version": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "eval_text_sha256": sha256_of_split("eval"), "args": vars(args),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    json_path = out.with_suffix(".json")
    previous = json.loads(json_path.read_text()) if args.resume and json_path.exists() else {}
    ignore = ("resume", "caches", "mem_bits")
    if previous and {k: v for k, v in previous["args"].items() if k not in ignore} != {
            k: v for k, v in vars(args).items() if k not in ignore}:
        raise ValueError(f"--resume: {json_path} was made with other settings: {previous['args']}")

    def save(rows=None) -> None:
        if rows is not None:
            result["perplexity"] = rows
        json_path.write_text(json.dumps(result, indent=2) + "\n")

    if previous:
        result["earlier_commands"] = previous.get("earlier_commands", []) + [previous["command"]]
    result["memory"] = (measure_memory(args.model, args.mem_bits, args.context, 1024) if args.mem_bits
                        else previous.get("memory", []))
    result["perplexity"] = previous.get("perplexity", [])
    save()
    if args.caches:
        result["perplexity"] = measure_perplexity(args.model, parse_specs(args.caches), args.num_seqs, args.seq_len, args.chunk,
                           DTYPES[args.dtype], previous.get("perplexity", []), save)
    base = next((r["ppl"] for r in result["perplexity"] if r["kind"] == "default"), None)
    for r in result["perplexity"]:
        if "ppl" in r and base:
            r["delta_pct"] = 100.0 * (r["ppl"] / base - 1.0)
    save()
    out.with_suffix(".md").write_text(to_markdown(result) + "\n")
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
