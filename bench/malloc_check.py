"""How much glibc's default allocator thresholds cost an elementwise op on a few MiB (docs/guide.md, "CPU allocator").

    python bench/malloc_check.py            # glibc's defaults
    python bench/malloc_check.py --tuned    # mmap and trim thresholds raised to 1 GiB with mallopt

Prints the median time of `(x * 2).sin()` on a [1, 3, 8192, 64] fp32 tensor (SmolLM2's keys of one layer at 8k) over
5 rounds of 50 ops, on 2 torch threads.
"""

import argparse
import ctypes
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuned", action="store_true", help="raise glibc's mmap and trim thresholds first")
    args = parser.parse_args()
    if args.tuned:
        libc = ctypes.CDLL("libc.so.6")
        for param in (-3, -1):  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
            if libc.mallopt(param, 1 << 30) != 1:
                raise SystemExit("mallopt failed: --tuned needs glibc")
    torch.set_num_threads(2)
    x = torch.randn(1, 3, 8192, 64)
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(50):
            (x * 2).sin()
        rounds.append((time.perf_counter() - t) / 50 * 1000)
    print(f"malloc {'tuned' if args.tuned else 'glibc defaults'}: {statistics.median(rounds):.2f} ms per op")


if __name__ == "__main__":
    main()
