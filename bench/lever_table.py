"""Lever tables: fidelity runs (`python -m eval.fidelity ... --out X`) rendered as one table per run, each row
saying which levers it turns on, against the targets of quality per bit.

    python bench/lever_table.py docs/results/levers3-smollm2-135m.json docs/results/levers3-gemma3-270m.json \
        --out docs/results/quality-per-bit.md

Rows of different runs (commits, documents, machines) are never put in one table: each run keeps its own section
with its command and commit. Columns: keys/values code bits, the levers (rotation and which streams, key levels,
value scale, key block, recent window, window bits, sliding layers, calibration or a per-layer budget), bits/value held, KL (95 % interval), top-1,
Δ PPL (95 % interval), and which target row (bits/value held ≤ 4.5 / 3.5 / 2.6) it meets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (bits/value held at most, KL at most or None, Δ PPL % at most, calibration allowed)
TARGETS = ((4.5, 0.005, 0.3, True), (3.5, 0.02, 1.5, False), (2.6, None, 8.0, True))


# What an option left out of a spec meant before commit 37e6f79 made the measured presets the defaults: runs made
# before it record only the options they were given, and are read with these.
LEGACY_DEFAULTS = {"k_bits": 4, "v_bits": 4, "rotation": "none", "rotate": "kv", "levels": "uniform",
                   "v_scale": "minmax", "k_group_size": 64, "recent_tokens": 128, "window_bits": 16,
                   "sliding_layers": "native", "sliding_bits": None}


def _options(row: dict) -> dict:
    """The options a row ran with: the resolved options the runner recorded (`options`), else its spec read with
    LEGACY_DEFAULTS (a run that predates the record)."""
    spec = row["spec"]
    given = dict(spec.get("options") or {})
    if row.get("options"):
        return {**row["options"], **{k: given[k] for k in ("calibration", "bits_per_value") if k in given}}
    if "preset" in given:  # a named setting: its options, then the spec's own
        from qcache.presets import recipe

        given = recipe(preset=given.pop("preset"), **given).to_dict()
    o = {**LEGACY_DEFAULTS, **given}
    if spec.get("bits") is not None:
        o["k_bits"] = o["v_bits"] = spec["bits"]
    return o


def _plan_label(pairs) -> str:
    """A per-layer plan by its mean widths: "plan K3.4V2.9"."""
    k = sum(p[0] for p in pairs) / len(pairs)
    v = sum(p[1] for p in pairs) / len(pairs)
    return f"plan K{k:.1f}V{v:.1f}"


def _levers(row: dict) -> dict:
    """What a row turns on, every option spelled out."""
    o = _options(row)
    rot = o.get("rotation") or "none"
    sliding = o.get("sliding_layers", "native")
    widths = o.get("sliding_bits")
    if widths is not None and o.get("sliding_v_bits") not in (None, widths):
        widths = f"K{widths}V{o['sliding_v_bits']}"
    if sliding == "quantized" and widths is not None:
        sliding = f"{widths}-bit"
    elif sliding == "tokens":  # each window token quantized on its own
        sliding = f"{widths or 'same'}-bit tokens"
    return {
        "kv": (f"plan ≤ {o['bits_per_value']}" if "bits_per_value" in o else _plan_label(o["layer_bits"])
               if o.get("layer_bits") else f"K{o['k_bits']}V{o['v_bits']}"),
        "rotation": "-" if rot == "none" else f"{rot} ({o.get('rotate') or 'kv'})",
        "levels": o.get("levels", "uniform"),
        "value scale": o.get("v_scale") or "minmax",
        "key block": str(o.get("k_group_size")),
        "recent": str(o.get("recent_tokens")),
        "window bits": str(o.get("window_bits")),
        "sliding": sliding,
        "calibrated": "yes" if o.get("calibration") else "no",
    }


def _meets(row: dict, calibrated: bool) -> str:
    met = []
    for bpv, kl, dppl, calib_ok in TARGETS:
        if row["bits_per_value"] > bpv or (calibrated and not calib_ok):
            continue
        if (kl is None or row["kl"] <= kl) and row["delta_ppl_pct"] <= dppl:
            met.append(f"≤ {bpv}")
    return ", ".join(met) or "-"


def render(path: Path) -> str:
    run = json.loads(path.read_text())
    git = run["git"]
    fidelity = [row for row in run["fidelity"] if not row.get("refused")]
    scored = (f"{run['settings']['docs']} document(s), {run['settings']['scored_per_doc']} predictions scored per "
              "document and cache" if fidelity else "needles only (no fidelity part)")
    lines = [f"## {run['model']} at {run['settings']['context']} tokens ({path.name})", "",
             f"Command: `{run['command']}`", "",
             f"git {git['commit'][:10]} ({'uncommitted changes' if git['dirty'] else 'clean tree'}); {scored}; "
             "weights (and the cache's full-precision parts) in "
             f"{run['settings'].get('dtype', 'bfloat16')}; "
             f"started {run['started']}.", ""]
    if not fidelity:
        return "\n".join(lines + _needle_table(run)[1:]) + "\n"
    head = ["K/V bits", "rotation", "levels", "value scale", "key block", "recent", "window bits", "sliding",
            "calibrated",
            "bits/value held", "KL [95 %]", "top-1 %", "Δ PPL % [95 %]", "meets"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * 9 + "---:|" * 4 + "---|"]
    for row in fidelity:
        if row["spec"]["kind"] == "default":
            lines.append("| default | | | | | | | | | " + f"{row['bits_per_value']:.2f} | 0 | 100 | PPL "
                         f"{run['reference_ppl']:.3f} | |")
            continue
        lv = _levers(row)
        ci = row.get("ci95", {})
        kl_ci = ci.get("kl", [float("nan")] * 2)
        d_ci = ci.get("delta_ppl_pct", [float("nan")] * 2)
        cells = list(lv.values()) + [
            f"{row['bits_per_value']:.2f}", f"{row['kl']:.4f} [{kl_ci[0]:.4f}, {kl_ci[1]:.4f}]",
            f"{100 * row['top1']:.1f}", f"{row['delta_ppl_pct']:+.2f} [{d_ci[0]:+.2f}, {d_ci[1]:+.2f}]",
            _meets(row, lv["calibrated"] == "yes")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _needle_table(run)
    return "\n".join(lines) + "\n"


def needles_kept(row: dict, ref: dict) -> list[str]:
    """Where a cache finds fewer needles than the default cache's Wilson 95 % interval allows: the length (and the
    depth thirds) whose share is below the lower end of the default's interval; [] when none is."""
    misses = []
    if row["share"] < ref["wilson95"][0]:
        misses.append(f"{row['length']}: {row['found']}/{row['needles']} < {100 * ref['wilson95'][0]:.0f} %")
    for mine, theirs in zip(row["by_third"], ref["by_third"]):
        if mine["needles"] and theirs["wilson95"] and mine["found"] / mine["needles"] < theirs["wilson95"][0]:
            misses.append(f"{row['length']} {('first', 'middle', 'last')[mine['third']]} third: "
                          f"{mine['found']}/{mine['needles']} < {100 * theirs['wilson95'][0]:.0f} %")
    return misses


def _needle_table(run: dict) -> list[str]:
    """Needles found per length (and per depth third) next to the default cache's, and whether every share stays at
    or above the lower end of the default's Wilson 95 % interval (the needle target)."""
    rows = [r for r in run.get("needles") or [] if "share" in r]
    refs = {r["length"]: r for r in rows if r["spec"]["kind"] == "default"}
    lengths = sorted(refs)
    if not lengths:
        return []
    lines = ["", f"Needles ({run['settings']['needles']} per length, depths 5-95 %): found % (needles found in the "
             "first / middle / last third of the depths) and bits/value held after the fill; 'kept' says whether every "
             "share is at or above the lower end of the default cache's Wilson 95 % interval, at every length and "
             "third.", "",
             "| cache | " + " | ".join(f"{n} found % | {n} bits/value" for n in lengths) + " | kept |",
             "|---|" + "---:|---:|" * len(lengths) + "---|"]
    labels = list(dict.fromkeys(r["cache"] for r in rows))
    for label in labels:
        mine = {r["length"]: r for r in rows if r["cache"] == label}
        cells, misses = [], []
        for n in lengths:
            r = mine.get(n)
            if r is None:
                cells += ["", ""]
                continue
            thirds = " / ".join(str(t["found"]) for t in r["by_third"])
            cells += [f"{100 * r['share']:.0f} ({thirds})", f"{r['bits_per_value']:.2f}"]
            if r["spec"]["kind"] != "default":
                misses += needles_kept(r, refs[n])
        kept = "(reference)" if label in {r["cache"] for r in refs.values()} else (
            "yes" if not misses else "no: " + "; ".join(misses))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {kept} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="fidelity JSON files (eval.fidelity --out X writes X.json)")
    p.add_argument("--out", type=Path, help="markdown file to write (default: print)")
    args = p.parse_args(argv)
    for path in args.runs:
        if not path.is_file():
            p.error(f"{str(path)!r} does not exist")
    targets = "; ".join(f"≤ {b} bits/value: " + (f"KL ≤ {k}, " if k is not None else "") + f"Δ PPL ≤ +{d} %"
                        + ("" if c else " (no calibration file)") for b, k, d, c in TARGETS)
    text = ("# Quality per bit: the levers, one table per run\n\n"
            f"Made by `python bench/lever_table.py {' '.join(str(r) for r in args.runs)}`. Targets: {targets}. "
            "'meets' names the target rows a cache meets on this run (one run's documents; the intervals say how "
            "sure).\n\n" + "\n".join(render(path) for path in args.runs))
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
