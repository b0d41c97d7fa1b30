"""Which layers' keys or values lose the needles: one layer's stream narrowed at a time, every other layer 8-bit.

    python bench/needle_layers.py --model smollm2-135m --stream k --bits 3 \
        --out docs/results/needle-layers-smollm2-135m-k3.md

A haystack of `--length` tokens of the calibration split (never the eval text) with `--needles` key-value needles
(`calibration.needles`); for each layer, a cache whose layer_bits are (8, 8) everywhere except that layer's keys (or values)
at `--bits`, filled once, then every needle's question + answer teacher-forced. Reported per layer: the mean answer
log-probability minus the all-8-bit cache's (negative: lost) and the needles found. What `calibration.budget.
needle_floors` measures (at 2048 tokens and 16 needles there), here at a longer haystack. Not a test: minutes on a CPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    from transformers import DynamicCache

    from calibration.needles import build_needles, fill_cache, score_needles
    from eval.provenance import git_state
    from qcache import QuantCache
    from qcache.tools.data import read_split
    from qcache.tools.models import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--stream", choices=("k", "v"), default="k")
    p.add_argument("--bits", type=int, choices=(2, 3, 4), default=3)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--needles", type=int, default=16)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.time()
    model, tok = load_model(args.model, dtype=torch.bfloat16)
    ids, needles = build_needles(tok, read_split("calibration"), args.length, args.needles, seed=args.seed)
    layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)

    def run(cache):
        scores = score_needles(model, fill_cache(model, cache, ids), needles)
        return sum(s.logprob for s in scores) / len(scores), sum(s.found for s in scores)

    default = run(DynamicCache(config=model.config))
    base = run(QuantCache(layer_bits=[(8, 8)] * layers))
    rows = []
    for layer in tqdm(range(layers), desc="layers"):
        pairs = [(8, 8)] * layers
        pairs[layer] = (args.bits, 8) if args.stream == "k" else (8, args.bits)
        logprob, found = run(QuantCache(layer_bits=pairs))
        rows.append((layer, logprob - base[0], found))
    state = git_state() or {"commit": "unknown", "dirty": True}
    stream = "keys" if args.stream == "k" else "values"
    lines = [f"# Needle loss per layer: {args.model}, {stream} at {args.bits} bits",
             "", f"Command: `python bench/needle_layers.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
             "", f"git {state['commit'][:10]} ({'uncommitted changes' if state['dirty'] else 'clean tree'}); "
             f"{args.needles} needles in "
             f"{args.length} tokens of the calibration split (seed {args.seed}); bf16; {time.time() - start:.0f} s.",
             "", f"Default cache: mean answer log-prob {default[0]:.3f}, found {default[1]}/{args.needles}; "
             f"every layer 8-bit: {base[0]:.3f}, found {base[1]}/{args.needles}.", "",
             "| layer | Δ answer log-prob vs all 8-bit | found |", "|---:|---:|---:|"]
    lines += [f"| {layer} | {d:+.3f} | {f}/{args.needles} |" for layer, d, f in rows]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
