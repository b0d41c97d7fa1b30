"""A per-layer plan from the needle loss per layer (`bench/needle_layers.py`'s tables), at the bits of a uniform one.

    python bench/needle_plan.py docs/results/needle-layers-smollm2-135m-k3rot.md \
        docs/results/needle-layers-smollm2-135m-v2rot.md

Reads one table of keys narrowed to K bits and one of values narrowed to V bits (each layer alone, every other layer
8-bit, needles in calibration text). Starts from K-bit keys and (V+1)-bit values in every layer, then:
1. keys go to 8 bits in each layer whose K-bit keys lose more than `--threshold` nats of answer log-probability;
2. those key bits are paid for bit for bit by values narrowed to V bits, in the layers whose V-bit values lose
   least, so the plan holds exactly the code bits of the uniform start. Keys and values
   of a layer carry the same metadata whatever their width, so equal code bits are equal bits/value held.
Prints the plan as `layer_bits` runs (`qcache.config.format_layer_bits`) for a `quant::layer_bits=...` spec or
`QuantCache(layer_bits=...)`. Raises where the value layers cannot pay for the keys. Not a test: reads two files.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_TITLE = re.compile(r"# Needle loss per layer: (\S+), (keys|values) at (\d+) bits")
_ROW = re.compile(r"\| (\d+) \| ([+-]\d+\.\d+) \| \d+/\d+ \|")


def read_table(path: Path) -> tuple[str, str, int, list[float]]:
    """(model, "k" or "v", bits, [loss per layer in nats, positive: lost]) from a `bench/needle_layers.py` table."""
    text = Path(path).read_text()
    title = _TITLE.search(text)
    if title is None:
        raise ValueError(f"{path}: no '# Needle loss per layer: MODEL, keys|values at N bits' title; allowed: a table "
                         "written by bench/needle_layers.py")
    rows = [(int(m.group(1)), float(m.group(2))) for m in _ROW.finditer(text)]
    if not rows or [layer for layer, _ in rows] != list(range(len(rows))):
        raise ValueError(f"{path}: its rows are not layers 0..N-1 in order; allowed: a table written by "
                         "bench/needle_layers.py")
    return title.group(1), title.group(2)[0], int(title.group(3)), [-delta for _, delta in rows]


def needle_plan(key_loss: list[float], key_bits: int, value_loss: list[float], value_bits: int,
                threshold: float) -> tuple[tuple[int, int], ...]:
    """The plan of the module docstring: one (k_bits, v_bits) per layer."""
    if len(key_loss) != len(value_loss):
        raise ValueError(f"the key table has {len(key_loss)} layers and the value table {len(value_loss)}; allowed: "
                         "tables of one model")
    pairs = [[key_bits, value_bits + 1] for _ in key_loss]
    owed = 0
    for layer, loss in enumerate(key_loss):
        if loss > threshold:
            pairs[layer][0] = 8
            owed += 8 - key_bits
    cheapest = sorted(range(len(value_loss)), key=lambda la: value_loss[la])
    if owed > len(cheapest):
        raise ValueError(f"{owed} key bits to pay for but only {len(cheapest)} value layers to narrow; allowed: a "
                         f"higher --threshold than {threshold}")
    for layer in cheapest[:owed]:
        pairs[layer][1] = value_bits
    return tuple((kb, vb) for kb, vb in pairs)


def main(argv=None) -> int:
    from qcache.config import format_layer_bits

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("keys", type=Path, help="bench/needle_layers.py table with --stream k")
    p.add_argument("values", type=Path, help="bench/needle_layers.py table with --stream v")
    p.add_argument("--threshold", type=float, default=0.2,
                   help="nats of answer log-probability above which a layer's keys go to 8 bits (default 0.2)")
    args = p.parse_args(argv)
    km, ks, kbits, kloss = read_table(args.keys)
    vm, vs, vbits, vloss = read_table(args.values)
    if (ks, vs) != ("k", "v") or km != vm:
        p.error(f"{args.keys} holds {km}'s {ks} and {args.values} {vm}'s {vs}; allowed: one model's keys, then its "
                "values")
    plan = needle_plan(kloss, kbits, vloss, vbits, args.threshold)
    print(format_layer_bits(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
