"""Flush micro-benchmark: the time to append one key block to a BlockLayer that already stores N tokens.

    python bench/bench_flush.py                          # writes docs/results/flush.{json,md}
    python bench/bench_flush.py --stored 1024 131072 --repeats 200

A tiny layer (CPU, bf16, 2 kv heads, head_dim 64, 4 bits, k_group_size 64, rope="post" so that only the store is
timed) is filled to N stored tokens, then one block of 64 new tokens is put in the residual and quantized into the
store (`BlockLayer._flush`: encode + append). Appending must cost the same whatever N is: the store is preallocated
and written in place, growing by a fraction of what it holds (qcache/store.py), where concatenating every stored
tensor per flush costs O(N). Reported: the median and mean time per appended block at each N (the mean includes the
occasional reallocation, amortized), and the ratio to the smallest N. Not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from qcache import __version__
from qcache.presets import recipe
from qcache.layers import BlockLayer

H, D, G = 2, 64, 64


def _git() -> dict:
    def run(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()

    return {"commit": run("git", "rev-parse", "HEAD"), "clean": run("git", "status", "--porcelain") == ""}


def filled_layer(stored: int) -> BlockLayer:
    """A layer holding `stored` tokens (sinks + quantized blocks + residual), filled in big chunks."""
    cfg = recipe(bits=4, k_group_size=G, rope="post", recent_tokens=128)
    layer = BlockLayer(cfg, 0, None)
    g = torch.Generator().manual_seed(0)
    done = 0
    while done < stored:
        n = min(8192, stored - done)
        kv = torch.randn(1, H, n, D, generator=g).to(torch.bfloat16)
        layer.update(kv, kv, kwargs={"position_ids": torch.arange(done, done + n)[None]})
        done += n
    return layer


def time_appends(layer: BlockLayer, repeats: int) -> list[float]:
    """Seconds per appended block: 64 tokens into the residual, then the flush that quantizes them into the store."""
    g = torch.Generator().manual_seed(1)
    block = torch.randn(1, H, G, D, generator=g).to(torch.bfloat16)
    times = []
    for _ in range(repeats):
        layer.store.append("residual", res_k=block, res_v=block)
        t0 = time.perf_counter()
        layer._flush()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stored", type=int, nargs="+", default=[1024, 32768, 131072], help="tokens stored before")
    parser.add_argument("--repeats", type=int, default=300, help="blocks appended (and timed) per size")
    parser.add_argument("--out", default="docs/results/flush", help="output path without extension")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for stored in tqdm(args.stored, desc="stored sizes"):
        layer = filled_layer(stored)
        time_appends(layer, 10)  # warm-up
        times = time_appends(layer, args.repeats)
        rows.append({"stored_tokens": stored, "median_ms": 1e3 * statistics.median(times),
                     "mean_ms": 1e3 * statistics.fmean(times), "max_ms": 1e3 * max(times),
                     "held_after": layer.stored_length()})
    base = rows[0]
    for row in rows:
        row["median_ratio"] = row["median_ms"] / base["median_ms"]
        row["mean_ratio"] = row["mean_ms"] / base["mean_ms"]
    report = {"command": " ".join(["python", "bench/bench_flush.py", *sys.argv[1:]]), "git": _git(),
              "qcache_version": __version__, "torch": torch.__version__, "machine": platform.platform(),
              "threads": 1, "layer": {"kv_heads": H, "head_dim": D, "k_group_size": G, "bits": 4, "dtype": "bf16"},
              "repeats": args.repeats, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Flush micro-benchmark: time per appended key block", "",
             f"`{report['command']}` at {report['git']['commit'][:10]}"
             f"{'' if report['git']['clean'] else ' (uncommitted changes)'}; torch {torch.__version__}, 1 thread, "
             f"a tiny bf16 layer ({H} kv heads, head_dim {D}, 4 bits, blocks of {G}); {args.repeats} blocks per "
             "size.", "",
             "| stored tokens | median ms/block | mean ms/block | max ms | median / smallest | mean / smallest |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['stored_tokens']} | {r['median_ms']:.3f} | {r['mean_ms']:.3f} | {r['max_ms']:.2f} | "
                     f"{r['median_ratio']:.2f} | {r['mean_ratio']:.2f} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
