"""The ablation of the quality-per-bit levers: each lever alone on top of a cache that has none of them, and each
lever taken out of (or added to) the defaults, at each width, in one fidelity run at the model's full context.

    python bench/ablation.py --model smollm2-135m --out docs/results/ablation-smollm2-135m
    python bench/ablation.py --model gemma3-270m --bits 3 --data-free --extra sliding8 --threads 1
    python bench/ablation.py --render docs/results/ablation-smollm2-135m.json     # the table again, from the JSON

Every row names all its options explicitly (none is left to the defaults of the day), so the table keeps its
meaning when the defaults change; `python -m eval.fidelity` measures them (`<out>.json`, `.md`, `.png`: KL, top-1,
Δ PPL against the default cache over the second half of each document, bits/value held) and this script writes
`<out>-table.md`: per width, the "none" row, "+ lever" rows, the defaults, and "defaults − / + lever" rows, each with
its change of KL against the row it modifies.

Levers (`LEVERS`): value rotation (min-max groups, or with one scale per token: `v_scale="norm"`), key rotation,
data-free Lloyd-Max levels, 128-token key blocks, the 8-bit residual window, a calibration file's codebooks
(`calibration=auto`: fitted on the calibration split first); `--extra sliding8` adds quantized 8-bit sliding-window
layers (Gemma-3), `--extra sliding4` 4-bit ones, `--extra sliding` sliding-window layers quantized at the row's
width.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# a cache with none of the levers: the defaults of the 2048-token round (unrotated, min-max, 64-token key blocks, a
# 16-bit window)
NONE = {"rotation": "none", "rotate": "kv", "v_scale": "minmax", "k_group_size": 64, "window_bits": 16}
# the defaults (the preset rows of qcache/presets.py, tests/test_presets.py), spelled out
DEFAULTS = {"rotation": "hadamard", "rotate": "auto", "v_scale": "norm", "levels": "uniform", "k_group_size": 128,
            "window_bits": 8}
DEFAULTS_AT = {2: {**DEFAULTS, "levels": "lloyd-max"}}  # widths whose defaults differ: 2-bit keys on Lloyd-Max levels
# a "defaults + lever" row whose lever the defaults of a width already have becomes this "defaults − lever" row
WITHOUT = {"defaults + Lloyd-Max key levels": ("defaults − Lloyd-Max key levels (uniform)", {"levels": "uniform"})}

# lever: (options that turn it on over NONE, the row of the defaults that takes it out or adds it, and that row's
# options over DEFAULTS)
LEVERS = {
    "value rotation, min-max groups": ({"rotation": "hadamard", "rotate": "v", "v_scale": "minmax"},
                                       "defaults − one scale per token (min-max value groups)", {"v_scale": "minmax"}),
    "value rotation + one scale per token": ({"rotation": "hadamard", "rotate": "v", "v_scale": "norm"},
                                             "defaults − value rotation (and its one scale per token)",
                                             {"rotation": "none", "rotate": "kv", "v_scale": "minmax"}),
    "key rotation": ({"rotation": "hadamard", "rotate": "k", "v_scale": "minmax"},
                     "defaults − per-layer key rotation (keys unrotated)", {"rotate": "v"}),
    "Lloyd-Max levels": ({"levels": "lloyd-max"}, "defaults + Lloyd-Max key levels", {"levels": "lloyd-max"}),
    "128-token key blocks": ({"k_group_size": 128}, "defaults − 128-token key blocks (64)", {"k_group_size": 64}),
    "8-bit window": ({"window_bits": 8}, "defaults − 8-bit window (16-bit)", {"window_bits": 16}),
    "calibrated codebooks": ({"calibration": "auto"}, "defaults + calibrated key codebooks", {"calibration": "auto"}),
}
EXTRA = {
    "sliding8": ("defaults + sliding layers quantized 8-bit", {"sliding_layers": "quantized", "sliding_bits": 8}),
    "sliding4": ("defaults + sliding layers quantized 4-bit", {"sliding_layers": "quantized", "sliding_bits": 4}),
    "sliding": ("defaults + sliding layers quantized at the same width", {"sliding_layers": "quantized"}),
}


def _spec(bits: int, options: dict) -> str:
    order = sorted(options, key=lambda k: (k == "calibration", k))  # calibration last, as the runner labels it
    return f"quant:{bits}:" + ",".join(f"{k}={options[k]}" for k in order)


def plan(widths: list[int], extra: list[str], data_free: bool = False) -> list[dict]:
    """The rows: per width, none, none + each lever, the defaults, the defaults ∓ each lever (and the extras);
    `data_free` leaves out the calibrated rows."""
    levers = {k: v for k, v in LEVERS.items() if not (data_free and "calibration" in v[0])}
    rows = []
    for bits in widths:
        rows.append({"bits": bits, "row": "none", "base": None, "spec": _spec(bits, NONE)})
        for name, (on, _, _) in levers.items():
            rows.append({"bits": bits, "row": f"none + {name}", "base": "none", "spec": _spec(bits, {**NONE, **on})})
        defaults = DEFAULTS_AT.get(bits, DEFAULTS)
        rows.append({"bits": bits, "row": "defaults", "base": None, "spec": _spec(bits, defaults)})
        changes = [(name, change) for _, name, change in levers.values()] + [EXTRA[key] for key in extra]
        for name, change in changes:
            if name in WITHOUT and all(defaults.get(k) == v for k, v in change.items()):
                name, change = WITHOUT[name]
            rows.append({"bits": bits, "row": name, "base": "defaults", "spec": _spec(bits, {**defaults, **change})})
    return rows


def render(report: dict, rows: list[dict]) -> str:
    """The ablation table of a finished run."""
    from eval.fidelity import CacheSpec

    by_label = {r["cache"]: r for r in report["fidelity"]}
    git = report["git"]
    lines = [f"# Ablation of the quality-per-bit levers: {report['model']} at {report['settings']['context']} tokens",
             "", f"Command: `{report['ablation_command']}` (which ran `{report['command']}`)", "",
             f"git {git['commit'][:10]} ({'uncommitted changes' if git['dirty'] else 'clean tree'}); "
             f"{report['settings']['docs']} document(s), {report['settings']['scored_per_doc']} predictions scored per "
             f"document and cache (the second half of the context), KL and Δ PPL against the default cache in the "
             f"same run (PPL {report['reference_ppl']:.3f}); weights in {report['settings'].get('dtype', 'bfloat16')}, "
             "and so are the cache's full-precision parts (sinks; the window with window_bits=16, held in the model's "
             f"dtype); started {report['started']}. Every row's options are spelled out in the JSON (`options`). "
             "ΔKL: this row's KL over the KL of the row it changes ('none' or 'defaults'); below 1 the lever helps.",
             ""]
    for bits in dict.fromkeys(r["bits"] for r in rows):
        lines += [f"## {bits}-bit keys and values", "",
                  "| row | bits/value held | KL [95 %] | KL ratio | top-1 % | Δ PPL % [95 %] |",
                  "|---|---:|---:|---:|---:|---:|"]
        kl_of = {}
        for r in (r for r in rows if r["bits"] == bits):
            got = by_label.get(CacheSpec.parse(r["spec"]).label)
            if got is None or "kl" not in got:
                why = (got or {}).get("refused") or (got or {}).get("error") or "not measured"
                lines.append(f"| {r['row']} | | {why} | | | |")
                continue
            kl_of[r["row"]] = got["kl"]
            ci = got.get("ci95", {})
            kl_ci, d_ci = ci.get("kl", [float("nan")] * 2), ci.get("delta_ppl_pct", [float("nan")] * 2)
            ratio = f"{got['kl'] / kl_of[r['base']]:.2f}" if r["base"] in kl_of else ""
            name = f"**{r['row']}**" if r["base"] is None else r["row"]
            lines.append(f"| {name} | {got['bits_per_value']:.2f} | {got['kl']:.4f} [{kl_ci[0]:.4f}, {kl_ci[1]:.4f}]"
                         f" | {ratio} | {100 * got['top1']:.1f} | {got['delta_ppl_pct']:+.2f} "
                         f"[{d_ci[0]:+.2f}, {d_ci[1]:+.2f}] |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="short name or HF directory (default smollm2-135m)")
    p.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2], choices=[2, 3, 4], help="widths (default 4 3 2)")
    p.add_argument("--extra", nargs="*", default=[], choices=sorted(EXTRA), help="extra rows on top of the defaults")
    p.add_argument("--data-free", action="store_true",
                   help="leave out the calibrated-codebook rows (each calibrates first: minutes per width)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per document (default: the model's full context)")
    p.add_argument("--dtype", default=None, help="model weights' dtype (default: the fidelity runner's, bfloat16)")
    p.add_argument("--docs", type=int, default=1, help="fidelity documents (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="output path without suffix (default docs/results/ablation-<model>)")
    p.add_argument("--render", type=Path, default=None, help="re-render the table of a finished run's JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.render is not None:
        if not args.render.is_file():
            p.error(f"--render {str(args.render)!r} does not exist")
        report = json.loads(args.render.read_text())
        if "ablation_rows" not in report:
            p.error(f"{args.render} is not an ablation run (no 'ablation_rows'); allowed: a JSON this script wrote")
        out = args.render.with_name(args.render.stem + "-table.md")
        out.write_text(render(report, report["ablation_rows"]))
        print(f"wrote {out}")
        return 0
    from eval import fidelity

    rows = plan(args.bits, args.extra, args.data_free)
    out = Path(args.out or f"docs/results/ablation-{Path(args.model).name}")
    argv_f = ["--model", args.model, "--docs", str(args.docs), "--out", str(out), "--needle-caches",
              "--caches", "default", *[r["spec"] for r in rows]]
    if args.threads is not None:
        argv_f += ["--threads", str(args.threads)]
    if args.context is not None:
        argv_f += ["--context", str(args.context)]
    if args.dtype is not None:
        argv_f += ["--dtype", args.dtype]
    if args.no_progress:
        argv_f.append("--no-progress")
    report = fidelity.main(argv_f)
    report["ablation_command"] = "python bench/ablation.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report["ablation_rows"] = rows
    Path(f"{out}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    table = Path(f"{out}-table.md")
    table.write_text(render(report, rows))
    print(f"wrote {table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
