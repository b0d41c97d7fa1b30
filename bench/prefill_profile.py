"""Where a prefill with QuantCache spends its time beyond DynamicCache's: cProfile of `--repeats` one-shot prefills
with each cache (after one untimed prefill each), and the functions whose time per prefill grew most.

    python bench/prefill_profile.py                      # SmolLM2, fp32, 1024 tokens, 2 threads: ~1 minute
    MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824 python bench/prefill_profile.py

The second line runs it with glibc's allocator thresholds raised (docs/guide.md, "CPU allocator"). Prints to stdout;
times under the profiler are inflated and noisy, the differences are what it is for. Not a test.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
from transformers import DynamicCache

from qcache import QuantCache
from qcache.tools.models import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def profile(model, ids: torch.Tensor, make, repeats: int) -> tuple[float, dict[str, float]]:
    """Seconds per prefill under the profiler, and the own (not cumulative) seconds per prefill of each function."""
    def prefill():
        with torch.no_grad():
            model(ids, past_key_values=make(), use_cache=True)

    prefill()  # untimed: one-time work (the C library, rotations, compiled functions)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(repeats):
        prefill()
    pr.disable()
    stats = pstats.Stats(pr)
    per_fn = {f"{file.split('/')[-1]}:{name}": row[2] / repeats for (file, _, name), row in stats.stats.items()}
    return stats.total_tt / repeats, per_fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=DTYPES[args.dtype])
    ids = torch.randint(100, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    default_s, default = profile(model, ids, DynamicCache, args.repeats)
    quant_s, quant = profile(model, ids, lambda: QuantCache(bits=4), args.repeats)
    print(f"seconds per prefill under the profiler: DynamicCache {default_s:.3f}, QuantCache(bits=4) {quant_s:.3f}")
    grown = sorted(((quant.get(k, 0.0) - default.get(k, 0.0), k) for k in set(default) | set(quant)), reverse=True)
    for delta, name in grown[:args.top]:
        print(f"{delta * 1e3:9.1f} ms  {name}")


if __name__ == "__main__":
    main()
