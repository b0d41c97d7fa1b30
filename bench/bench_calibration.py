"""Calibration benchmark (issue: calibration): chunked perplexity of calibrated vs uncalibrated QuantCache vs the
default cache and Transformers' quantized caches, in one run, with the average bits per value each cache holds.

    python bench/bench_calibration.py --model smollm2-135m --bits 4 3 2 --out docs/results/calibration-smollm2
    python bench/bench_calibration.py --model gemma3-270m --bits 4 3 2 --out docs/results/calibration-gemma3

Calibration text (qcache.tools.data "calibration" split) and evaluation text ("eval" split) are disjoint files.
Not a test: minutes to hours on a 2-core CPU. Rows are written as they finish (--resume continues a run).
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

from calibration import calibrate
from qcache import QuantCache, QuantCacheConfig, __version__
from eval.caches import build_cache, cache_label
from qcache.calibfile import save_calibration
from calibration.cli import sample_sequences
from qcache.tools.data import read_split, sha256_of_split, token_sequences
from qcache.tools.models import load_model
from eval.perplexity import chunked_nll

from bench_speed import cache_bytes  # noqa: E402  (bench/ is the script's directory)

log = logging.getLogger("bench_calibration")


def bits_per_value(cache, model_config, ids) -> float | None:
    """Average stored bits per K/V value: every byte the cache holds (codes, scales, codebooks, static ranges,
    outliers, full-precision tokens, positions; Transformers' caches: their quantized tensors with their scales, and
    their full-precision residual) over the number of values a 16-bit cache would hold. The default cache: the
    model dtype's bits."""
    c = model_config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    values = 0
    for layer in cache.layers:
        values += 2 * c.num_key_value_heads * head_dim * ids.shape[0] * min(
            ids.shape[1], getattr(layer, "sliding_window", None) or ids.shape[1])
    return 8 * cache_bytes(cache) / values


TARGET_PCT = {4: 0.5, 3: 2.0, 2: 15.0}  # the calibration issue's ceilings on the perplexity change


def targets_section(rows: list[dict]) -> list[str]:
    """Per width: the best calibrated row against the issue's ceiling, the uncalibrated rows and the peers."""
    ok = [r for r in rows if "error" not in r and "delta_pct" in r]
    lines = ["", "## Targets (best calibrated row per width)", "", "| target | measured | |", "|---|---|---|"]
    for bits in sorted({r["bits"] for r in ok if r.get("bits")}, reverse=True):
        cal = [r for r in ok if r["kind"].startswith("quant-calibrated") and r["bits"] == bits]
        if not cal:
            continue
        best = min(cal, key=lambda r: r["ppl"])
        name = f"{best['cache']} ({best['bits_per_value']:.2f} bits/value)"
        if bits in TARGET_PCT:
            lines.append(f"| calibrated {bits}-bit <= +{TARGET_PCT[bits]} % | {name}: {best['delta_pct']:+.2f} % | "
                         f"{'PASS' if best['delta_pct'] <= TARGET_PCT[bits] else '**FAIL**'} |")
        for other in ok:
            if other.get("bits") != bits or other["kind"] == "default" or other["kind"].startswith("quant-calibrated"):
                continue
            if other["kind"] == "quant" and bits not in (3, 2):
                continue  # the issue asks calibrated > uncalibrated at 3 and 2 bits
            lines.append(f"| calibrated {bits}-bit beats {other['cache']} ({other['delta_pct']:+.2f} %) | "
                         f"{best['delta_pct']:+.2f} % | {'PASS' if best['ppl'] < other['ppl'] else '**FAIL**'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="short name or HF directory")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2], choices=[2, 3, 4, 8], help="bit widths")
    p.add_argument("--peers", nargs="*", default=["hf-quanto", "hf-hqq"], help="Transformers caches to compare")
    p.add_argument("--static-keys", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure calibrated caches with static key ranges")
    p.add_argument("--outliers", type=int, nargs="+", default=[0, 1],
                   help="QuantCacheConfig.outliers values measured (uncalibrated and calibrated rows for each)")
    p.add_argument("--samples", type=int, default=16, help="calibration sequences")
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sequence")
    p.add_argument("--num-seqs", type=int, default=4, help="eval sequences")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per eval sequence")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward")
    p.add_argument("--out", default="docs/results/calibration", help="output path without extension")
    p.add_argument("--resume", action="store_true", help="keep finished rows found in --out")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done, previous = {}, {}
    if args.resume and out.with_suffix(".json").exists():
        previous = json.loads(out.with_suffix(".json").read_text())
        done = {r["cache"]: r for r in previous["rows"] if "ppl" in r or "error" in r}
    model, tok = load_model(args.model, dtype=torch.float32)
    eval_ids = token_sequences(tok, "eval", args.num_seqs, args.seq_len)
    calib_ids = sample_sequences(tok, read_split("calibration"), args.samples, args.calib_len, seed=0)
    result = {"command": " ".join(["python", "bench/bench_calibration.py", *(argv or sys.argv[1:])]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "qcache_version": __version__, "args": vars(args),
              "eval_sha256": sha256_of_split("eval"), "calibration_sha256": sha256_of_split("calibration"),
              "calibration_seconds": dict(previous["calibration_seconds"]) if done else {}, "rows": []}

    def save():
        out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")

    def measure(label, make, extra):
        if label in done:
            result["rows"].append(done[label])
            return
        t0 = time.perf_counter()
        holder = {}

        def tracked():
            holder["cache"] = make()
            return holder["cache"]

        nll, n = chunked_nll(model, eval_ids, tracked, chunk=args.chunk, progress=True, desc=label)
        row = {"cache": label, **extra, "ppl": math.exp(nll / n), "seconds": time.perf_counter() - t0,
               "bits_per_value": bits_per_value(holder["cache"], model.config, eval_ids)}
        result["rows"].append(row)
        log.info("%s: ppl %.4f, %s bits/value", label, row["ppl"], row["bits_per_value"])
        save()

    measure("default", lambda: build_cache("default", model.config), {"kind": "default"})
    def calibrated(bits: int, static: bool, outliers: int) -> None:
        suffix = ("-static-keys" if static else "") + (f"-outliers{outliers}" if outliers else "")
        label = f"quant-{bits}bit-calibrated{suffix}"
        if label in done:
            result["rows"].append(done[label])
            return
        path = out.parent / f".{out.name}-{bits}bit{suffix}.qcache.safetensors"
        t0 = time.perf_counter()
        data = calibrate(model, calib_ids, QuantCacheConfig(bits=bits, static_keys=static, outliers=outliers),
                         {"model": args.model, "data_source": "calibration split",
                          "data_sha256": result["calibration_sha256"], "samples": args.samples,
                          "seq_len": args.calib_len})
        result["calibration_seconds"][f"{bits}{suffix}"] = time.perf_counter() - t0
        save_calibration(path, data)
        measure(label, lambda: QuantCache.from_calibration(path), {"kind": "quant-calibrated" + suffix,
                                                                    "bits": bits, "outliers": outliers})

    for bits in tqdm(args.bits, desc="bits"):
        for outliers in args.outliers:
            measure(f"quant-{bits}bit" + (f"-outliers{outliers}" if outliers else ""),
                    lambda: QuantCache(model.config, bits=bits, outliers=outliers),
                    {"kind": "quant", "bits": bits, "outliers": outliers})
            for static in ([False, True] if args.static_keys and not outliers else [False]):
                calibrated(bits, static, outliers)
        for peer in args.peers:
            try:
                build_cache(peer, model.config, bits)
            except (ValueError, ImportError) as err:
                result["rows"].append({"cache": cache_label(peer, bits), "kind": peer, "bits": bits,
                                       "error": str(err)})
                continue
            try:
                measure(cache_label(peer, bits), lambda: build_cache(peer, model.config, bits), {"kind": peer,
                                                                                                 "bits": bits})
            except RuntimeError as err:  # a peer that breaks mid-run is recorded, not the end of the benchmark
                log.exception("%s failed", cache_label(peer, bits))
                result["rows"].append({"cache": cache_label(peer, bits), "kind": peer, "bits": bits,
                                       "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
                save()
    base = next(r["ppl"] for r in result["rows"] if r["cache"] == "default")
    lines = [f"# Calibration benchmark: {args.model}", "", f"Command: `{result['command']}`  ",
             f"Date {result['date']}; eval text sha256 {result['eval_sha256'][:12]}…, calibration text sha256 "
             f"{result['calibration_sha256'][:12]}… (disjoint files); calibration seconds per width: "
             + ", ".join(f"{b}: {s:.0f}" for b, s in result["calibration_seconds"].items()), "",
             "| cache | PPL | vs default | bits/value held |", "|---|---:|---:|---:|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['cache']} | n/a | {r['error']} | |")
            continue
        r["delta_pct"] = 100 * (r["ppl"] / base - 1)
        bpv = f"{r['bits_per_value']:.2f}" if r.get("bits_per_value") is not None else "n/a"
        lines.append(f"| {r['cache']} | {r['ppl']:.4f} | {r['delta_pct']:+.2f} % | {bpv} |")
    lines += targets_section(result["rows"])
    save()
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
