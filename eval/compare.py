"""Compare KV caches with lm-eval in one run: perplexity and retrieval, as deltas vs the default cache.

    python -m eval.compare                                  # SmolLM2-135M defaults (~15 min on 2 CPU cores)
    python -m eval.compare --model gemma3-270m --lengths 1024 4096 --samples 20 --ppl-docs 12

Every cache in `--caches` gets the perplexity task (qcache_ppl: `--ppl-docs` documents of the "eval" text
split); every cache in `--retrieval-caches` gets the retrieval tasks (RULER niah_*, qcache_passkey) at each of
`--lengths`, `--samples` prompts each, generating at most `--max-gen-toks` tokens. The model is loaded once; each
cache sees the same documents and prompts. Quality is reported against the default cache of the same run:
perplexity as a % change, accuracy as a difference in points. Times are recorded as ratios (they are noise
on shared machines).

Outputs `<out>.json` (everything, with the command line), `<out>.md` (tables) and `<out>.png` (perplexity
change vs bits per cache kind; accuracy vs context length per retrieval task). Not a test.

A cache spec is KIND[:BITS][:OPTION=VALUE,...], e.g. `default`, `quant:4`, `hf-quanto:2`, `hf-fp8`,
`quant::k_bits=4,v_bits=2`, `quant:4:recent_tokens=0`, `quant:4:calibration=smollm2.qcache.safetensors`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .harness import RETRIEVAL_TASKS, offline_environment, task_manager
from .provenance import git_state, load_average

log = logging.getLogger("eval.compare")

DEFAULT_CACHES = ("default", "quant:2", "quant:3", "quant:4", "quant:8", "hf-quanto:2", "hf-quanto:4", "hf-hqq:2",
                  "hf-hqq:4", "hf-fp8")
DEFAULT_RETRIEVAL_CACHES = ("default", "quant:2", "quant:4", "hf-quanto:2")
DEFAULT_RETRIEVAL_TASKS = ("niah_single_1", "qcache_passkey")  # the multikey tasks: 0 for SmolLM2's default cache
PPL_TASK = "qcache_ppl"
PPL_METRICS = ("token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte")
# lm-eval loggers whose INFO lines repeat for every cache row ("Building contexts ...", "Running ... requests");
# raised to WARNING unless --verbose. Nothing else is touched: warnings from lm-eval, transformers and datasets show.
QUIET_INFO_LOGGERS = ("lm_eval.api.task", "lm_eval.evaluator")


@dataclass(frozen=True)
class CacheSpec:
    """One cache of the comparison: kind, bits and options, as given on the command line."""

    kind: str
    bits: int | None = None
    options: dict = field(default_factory=dict, hash=False)

    @classmethod
    def parse(cls, text: str) -> "CacheSpec":
        """'quant:4:recent_tokens=0' -> CacheSpec('quant', 4, {'recent_tokens': '0'}) (`qcache.tools.spec`)."""
        from eval.caches import CACHE_KINDS
        from qcache.tools.spec import parse_spec

        try:
            kind, bits, options = parse_spec(text, CACHE_KINDS)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return cls(kind, bits, options)

    @property
    def label(self) -> str:
        from eval.caches import cache_label

        return cache_label(self.kind, self.bits, **self.options)

    @property
    def nominal_bits(self) -> float:
        """Bits per stored K/V value, for the plot's x axis (16 for the default cache)."""
        if self.kind == "default":
            return 16.0
        if self.kind == "hf-fp8":
            return 8.0
        if self.bits is None and self.options.get("layer_bits"):
            from qcache.config import QuantCacheConfig

            return QuantCacheConfig(layer_bits=self.options["layer_bits"]).mean_bits()
        k = int(self.options.get("k_bits", self.bits or 4))
        v = int(self.options.get("v_bits", self.bits or 4))
        return (k + v) / 2 if self.bits is None else float(self.bits)


# ---------------------------------------------------------------------------------------------------------
# Running lm-eval
# ---------------------------------------------------------------------------------------------------------


def _seed(seed: int = 1234) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _prepare(loaded: dict, max_gen_toks: int | None) -> None:
    """What simple_evaluate does to tasks before evaluating: zero-shot, and our generation length."""
    for task in loaded["tasks"].values():
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        if max_gen_toks is not None and task.get_config("output_type") == "generate_until":
            task.set_config(key="generation_kwargs", value={"max_gen_toks": max_gen_toks}, update=True)


def _evaluate(lm, loaded: dict, limit: int | None) -> tuple[dict, float]:
    """lm-eval's results for `loaded` tasks through `lm`'s current cache, and the seconds it took."""
    from lm_eval.evaluator import evaluate

    _seed()
    start = time.perf_counter()
    out = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=False)
    return out["results"], time.perf_counter() - start


def _failed(spec: CacheSpec, err: Exception) -> str:
    """A cache that fails mid-run is recorded (JSON and table) rather than ending the comparison."""
    log.exception("%s failed", spec.label)
    return f"{type(err).__name__}: {err}"


def auto_calibration(model, tokenizer, spec: CacheSpec) -> dict:
    """`calibration=auto`: calibrate the loaded model for this spec's options on the calibration split (text the
    evaluation never reads) and use the file; other options are returned unchanged. With a rotation and no `rotate`
    in the spec, the calibration also chooses whether keys are rotated (`calibration.budget.choose_rotate`)."""
    if "needle_floor" in spec.options and "bits_per_value" not in spec.options:
        raise ValueError(f"needle_floor={spec.options['needle_floor']} sets floors under the widths bits_per_value "
                         "chooses; allowed: calibration=auto,bits_per_value=B,needle_floor=NATS")
    if "needle_length" in spec.options and "needle_floor" not in spec.options:
        raise ValueError(f"needle_length={spec.options['needle_length']} is the haystack the needle floors are "
                         "measured on; allowed: calibration=auto,bits_per_value=B,needle_floor=NATS,needle_length=N")
    if spec.options.get("calibration") != "auto":
        if "bits_per_value" in spec.options:
            raise ValueError(f"bits_per_value={spec.options['bits_per_value']} needs calibration=auto (the widths are "
                             "chosen by calibrating); allowed: calibration=auto,bits_per_value=B")
        return spec.options
    from calibration.cli import calibrate_model, max_context, rotation_choice, save_calibration
    from qcache.presets import recipe

    from .options import parse_cache_options

    bits, options = parse_cache_options({k: v for k, v in spec.options.items() if k != "calibration"})
    budget = options.pop("bits_per_value", None)
    needle_floor = options.pop("needle_floor", None)
    needle_length = options.pop("needle_length", None)
    config = recipe(bits=bits if bits is not None else spec.bits, **options)
    if budget is not None:  # per-layer widths within `budget` bits/value at the model's full context
        budget = {"budget": budget, "samples": 1, "seq_len": 2048, "needle_floor": needle_floor,
                  "needle_length": needle_length,
                  "context": max_context(model, "a model that sets it (bits_per_value counts at the full context)")}
    from qcache.tools.models import default_cache_dir

    name = Path(model.config.name_or_path or "model").name
    path = default_cache_dir() / "calibration" / f"{name}-{spec.label}.qcache.safetensors".replace("/", "_")
    start = time.perf_counter()
    log.info("%s: calibrating %s on the calibration split first (progress below)", spec.label, name)
    choose, try_levels = rotation_choice(config, options)  # keys rotated too, if that measures better
    save_calibration(path, calibrate_model(model, tokenizer, config, name, progress=True, budget=budget,
                                           choose_rotation=choose, try_levels=try_levels))
    log.info("%s: calibrated in %.0f s -> %s", spec.label, time.perf_counter() - start, path)
    return {**{k: v for k, v in spec.options.items() if k not in ("bits_per_value", "needle_floor", "needle_length")},
            "calibration": str(path)}


def _use(lm, spec: CacheSpec) -> str | None:
    """Switch `lm` to `spec`; the error message when the cache cannot be built for this model."""
    try:
        lm.set_cache(spec.kind, bits=spec.bits, **auto_calibration(lm.model, lm.tokenizer, spec))
    except (ValueError, ImportError, NotImplementedError) as err:
        log.warning("%s: %s", spec.label, err)
        return str(err)
    return None


def _comparable(identity: dict | None) -> dict | None:
    """What must match for saved rows to be reused: rows are keyed by cache and length, so the lengths asked for
    may differ (a run can be finished length by length)."""
    return None if identity is None else {k: v for k, v in identity.items() if k != "lengths"}


class Checkpoint:
    """Rows finished so far, kept in `<out>.partial.json` so that `--resume` skips them after an interruption.

    A resumed run must have the same model and settings as the one that wrote the file; otherwise it raises
    rather than mixing results of two different runs.
    """

    def __init__(self, path: Path, identity: dict, resume: bool, report: Path | None = None):
        self.path, self.identity, self.rows = path, identity, {}
        if resume and not path.exists() and report is not None and report.exists():
            # a finished run: its report's rows, to extend it (more caches or lengths)
            done = json.loads(report.read_text())
            rows = {f"ppl|{r['cache']}": r for r in done["perplexity"] if "error" not in r}
            rows.update({f"retrieval|{r['cache']}|{r['length']}": r for r in done["retrieval"] if "error" not in r})
            for row in rows.values():  # deltas are recomputed against this run's rows
                for key in [k for k in row if k.endswith(("_change_pct", "_delta")) or k == "time_ratio"]:
                    del row[key]
            self.path.write_text(json.dumps({"identity": {"model": done["model"], **done["settings"]},
                                             "rows": rows}, indent=1, default=str))
        if resume and path.exists():
            saved = json.loads(path.read_text())
            if _comparable(saved.get("identity")) != _comparable(identity):
                raise ValueError(f"--resume: {path} was written by a run with other settings "
                                 f"({saved.get('identity')}); this run has {identity}. Delete it or drop --resume.")
            self.rows = saved["rows"]
            log.info("resuming: %d rows from %s", len(self.rows), path)
        self.resumed = len(self.rows)  # rows this run did not measure

    def get(self, key: str) -> dict | None:
        return self.rows.get(key)

    def put(self, key: str, row: dict) -> None:
        self.rows[key] = row
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": self.identity, "rows": self.rows}, indent=1, default=str))
        os.replace(tmp, self.path)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


def run_perplexity(lm, specs: list[CacheSpec], path: str, docs: int, doc_chars: int,
                   checkpoint: Checkpoint | None = None) -> tuple[list[dict], int]:
    """One row per cache, and the number of tokens scored."""
    loaded = task_manager({"pretrained": path, "ppl_doc_chars": doc_chars}).load([PPL_TASK])
    _prepare(loaded, None)
    test_docs = loaded["tasks"][PPL_TASK].test_docs()
    tokens = sum(test_docs.select(range(min(docs, len(test_docs))))["num_tokens"])
    rows = []
    for spec in specs:
        if checkpoint is not None and (done := checkpoint.get(f"ppl|{spec.label}")) is not None:
            rows.append(done)
            continue
        row = {"cache": spec.label, "kind": spec.kind, "bits": spec.bits, "options": spec.options,
               "nominal_bits": spec.nominal_bits}
        if (error := _use(lm, spec)) is not None:
            rows.append({**row, "error": error})
            continue
        updates = lm.cache_updates
        try:
            results, seconds = _evaluate(lm, loaded, docs)
        except (RuntimeError, ValueError, NotImplementedError) as err:
            rows.append({**row, "error": _failed(spec, err)})
            continue
        metrics = {m: results[PPL_TASK].get(f"{m},none") for m in PPL_METRICS}
        rows.append({**row, **metrics, "seconds": seconds, "cache_updates": lm.cache_updates - updates})
        if checkpoint is not None:
            checkpoint.put(f"ppl|{spec.label}", rows[-1])
        log.info("%s: token PPL %.4f (%.0f s)", spec.label, metrics["token_perplexity"] or math.nan, seconds)
    return rows, tokens


def run_retrieval(lm, specs: list[CacheSpec], path: str, tasks: list[str], lengths: list[int], samples: int,
                  max_gen_toks: int, checkpoint: Checkpoint | None = None) -> list[dict]:
    """One row per cache and length: the accuracy of each task on the same `samples` prompts."""
    rows = []
    for length in lengths:
        if checkpoint is not None and all(checkpoint.get(f"retrieval|{s.label}|{length}") for s in specs):
            rows.extend(checkpoint.get(f"retrieval|{s.label}|{length}") for s in specs)
            continue
        metadata = {"pretrained": path, "tokenizer": path, "max_seq_lengths": [length],
                    "passkey_samples": samples}
        loaded = task_manager(metadata).load(tasks)
        _prepare(loaded, max_gen_toks)
        for spec in specs:
            if checkpoint is not None and (done := checkpoint.get(f"retrieval|{spec.label}|{length}")) is not None:
                rows.append(done)
                continue
            row = {"cache": spec.label, "kind": spec.kind, "bits": spec.bits, "options": spec.options,
                   "length": length}
            if (error := _use(lm, spec)) is not None:
                rows.append({**row, "error": error})
                continue
            try:
                results, seconds = _evaluate(lm, loaded, samples)
            except (RuntimeError, ValueError, NotImplementedError) as err:
                rows.append({**row, "error": _failed(spec, err)})
                continue
            scores = {task: _score(results[task], length) for task in tasks}
            rows.append({**row, "accuracy": scores, "seconds": seconds})
            if checkpoint is not None:
                checkpoint.put(f"retrieval|{spec.label}|{length}", rows[-1])
            log.info("%s @ %d: %s (%.0f s)", spec.label, length, scores, seconds)
    return rows


def _score(task_results: dict, length: int) -> float | None:
    """Accuracy of one task: RULER reports it under the length, our passkey under exact_match."""
    for key in (f"{length},none", "exact_match,none"):
        if key in task_results and task_results[key] != -1:
            return float(task_results[key])
    return None


# ---------------------------------------------------------------------------------------------------------
# Deltas, tables, plot
# ---------------------------------------------------------------------------------------------------------


def add_deltas(ppl_rows: list[dict], retrieval_rows: list[dict]) -> None:
    """Perplexity: % change vs the default row; accuracy: points vs the default row at the same length."""
    base = next((r for r in ppl_rows if r["kind"] == "default" and "error" not in r), None)
    for row in ppl_rows:
        if base is None or "error" in row or row is base:
            continue
        for m in ("token_perplexity", "word_perplexity", "byte_perplexity"):
            if row.get(m) is not None and base.get(m):
                row[f"{m}_change_pct"] = 100 * (row[m] / base[m] - 1)
        if row.get("bits_per_byte") is not None and base.get("bits_per_byte") is not None:
            row["bits_per_byte_delta"] = row["bits_per_byte"] - base["bits_per_byte"]
        row["time_ratio"] = row["seconds"] / base["seconds"]
    for row in retrieval_rows:
        base = next((r for r in retrieval_rows if r["kind"] == "default" and r["length"] == row["length"]
                     and "error" not in r), None)
        if base is None or "error" in row or row is base:
            continue
        row["accuracy_delta"] = {t: (a - base["accuracy"][t]) if a is not None and base["accuracy"][t] is not None
                                 else None for t, a in row["accuracy"].items()}
        row["time_ratio"] = row["seconds"] / base["seconds"]


def _fmt(value, spec: str, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, ("+" if signed else "") + spec)


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"# KV cache comparison: {report['model']}", "",
        f"Command: `{report['command']}`", "",
        f"{report['started']}, {report['seconds_total']:.0f} s in all on {report['machine']} (load average "
        f"{_fmt_load(report.get('load_average'))}); qcache "
        f"{report['versions']['qcache']}, lm-eval {report['versions']['lm_eval']}, transformers "
        f"{report['versions']['transformers']}, torch {report['versions']['torch']}, {s['dtype']}; "
        f"{_fmt_git(report.get('git'))}.", "",
        "Quality is measured against the default cache (DynamicCache) in the same run: perplexity as % change, "
        "accuracy in points. Times are ratios to the default (absolute times on shared machines are noise).",
    ]
    if report.get("resumed"):
        rows = report["perplexity"] + report["retrieval"]
        lines += ["", f"Resumed (`--resume`): {report['resumed']} rows come from earlier runs with the same settings "
                  f"(saved after each row); all rows took {sum(r.get('seconds', 0) for r in rows):.0f} s together "
                  "(each row's seconds are in the JSON)."]
    if report["perplexity"]:
        lines += _perplexity_section(report)
    if report["retrieval"]:
        lines += _retrieval_section(report)
    errors = [r for r in report["perplexity"] + report["retrieval"] if "error" in r]
    if errors:
        lines += ["", "Caches that could not run on this model: "
                  + "; ".join(f"{r['cache']}: {r['error']}" for r in errors)]
    return "\n".join(lines) + "\n"


def _fmt_git(git: dict | None) -> str:
    if not git:
        return "not a git checkout"
    return f"git {git['commit'][:10]}" + (" with uncommitted changes" if git["dirty"] else "")


def _fmt_load(load: dict | None) -> str:
    if not load or not load.get("start"):
        return "n/a"
    return f"{load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end"


def _perplexity_section(report: dict) -> list[str]:
    s, tokens = report["settings"], report["ppl_tokens"]
    lines = [
        "", f"## Perplexity ({PPL_TASK}: {s['ppl_docs']} documents of ~{s['ppl_doc_chars']} characters of the eval "
        f"split, {tokens or 'n/a'} tokens, fed {s['chunk_size']} tokens at a time through the cache)", "",
        *([f"**{tokens} tokens is short of a long context: the full-precision tokens are a larger share of the cache "
            "there, and changes under 1 % are noise (`python -m eval.fidelity` measures at the model's full "
            "context).**", ""]
          if (tokens or 0) < 8192 else []),
        "| cache | token PPL | Δ token PPL | Δ word PPL | Δ bits/byte | time vs default |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["perplexity"]:
        if "error" in r:
            lines.append(f"| {r['cache']} | error: {r['error'][:80]} | | | | |")
        elif r["kind"] == "default":
            lines.append(f"| {r['cache']} | {_fmt(r['token_perplexity'], '.4f')} | (reference) | word PPL "
                         f"{_fmt(r['word_perplexity'], '.3f')} | {_fmt(r['bits_per_byte'], '.4f')} bits/byte | 1.00 |")
        else:
            lines.append(
                f"| {r['cache']} | {_fmt(r['token_perplexity'], '.4f')} | "
                f"{_fmt(r.get('token_perplexity_change_pct'), '.2f', True)} % | "
                f"{_fmt(r.get('word_perplexity_change_pct'), '.2f', True)} % | "
                f"{_fmt(r.get('bits_per_byte_delta'), '.4f', True)} | {_fmt(r.get('time_ratio'), '.2f')} |")
    return lines


def _retrieval_section(report: dict) -> list[str]:
    s = report["settings"]
    tasks, lengths = s["retrieval_tasks"], s["lengths"]
    header = [f"{t} @ {n}" for n in lengths for t in tasks]
    lines = ["", f"## Retrieval ({', '.join(tasks)}; {s['samples']} prompts per task and length, at most "
             f"{s['max_gen_toks']} generated tokens; prompts sized with the model's tokenizer)", "",
             "Accuracy of the default cache; the others as the difference in points.", "",
             "| cache | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    for label in dict.fromkeys(r["cache"] for r in report["retrieval"]):
        cells = []
        for n in lengths:
            row = next((r for r in report["retrieval"] if r["cache"] == label and r["length"] == n), None)
            for t in tasks:
                if row is None or "error" in row:
                    cells.append("error" if row else "")
                elif row["kind"] == "default":
                    a = row["accuracy"][t]
                    cells.append(_fmt(100 * a if a is not None else None, ".0f") + " %")
                else:
                    d = row.get("accuracy_delta", {}).get(t)
                    cells.append(_fmt(100 * d if d is not None else None, ".0f", True) + " pt")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _plot_perplexity(ax, report: dict) -> None:
    lines: dict[str, list] = {}
    for r in report["perplexity"]:
        if r["kind"] != "default" and r.get("token_perplexity_change_pct") is not None:
            key = r["cache"] if r.get("options") else r["kind"]  # option variants: points of their own
            lines.setdefault(key, []).append((r["nominal_bits"], r["token_perplexity_change_pct"]))
    for key, pts in lines.items():
        ax.plot(*zip(*sorted(pts)), marker="o", label=key)
    lowest = min((y for pts in lines.values() for _, y in pts), default=0.0)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("bits per stored K/V value")
    ax.set_ylabel("token perplexity change vs default (%)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(bottom=min(1.5 * lowest, -0.5))  # symlog: no empty decades below zero
    ax.set_title(f"{PPL_TASK} ({report['ppl_tokens'] or '?'} tokens)")
    if lines:
        ax.legend(fontsize=8)


def plot(report: dict, path: Path) -> None:
    """Perplexity change vs bits (one line per cache kind) and accuracy vs length (one panel per task)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = report["settings"]["retrieval_tasks"] if report["retrieval"] else []
    panels = bool(report["perplexity"]) + len(tasks)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(5.5 * max(panels, 1), 4.2), squeeze=False)
    if report["perplexity"]:
        _plot_perplexity(axes[0][0], report)
    for ax, task in zip(axes[0][bool(report["perplexity"]):], tasks):
        labels = list(dict.fromkeys(r["cache"] for r in report["retrieval"]))
        for i, label in enumerate(labels):
            shift = 2 ** (0.04 * (i - (len(labels) - 1) / 2))  # side by side where accuracies coincide
            pts = sorted((r["length"] * shift, 100 * r["accuracy"][task]) for r in report["retrieval"]
                         if r["cache"] == label and "error" not in r and r["accuracy"][task] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label, ls="-" if label == "default" else "--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["settings"]["lengths"], [str(n) for n in report["settings"]["lengths"]])
        ax.set_xlabel("context length (tokens; caches drawn side by side)")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(-5, 105)
        ax.set_title(f"{task} ({report['settings']['samples']} prompts per length)")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['model']}: KV caches vs the default cache, same run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="short name, local HF directory or hub id")
    p.add_argument("--caches", nargs="*", type=CacheSpec.parse, default=[CacheSpec.parse(c) for c in DEFAULT_CACHES],
                   metavar="SPEC", help=f"caches for perplexity (none: skip it; default: {' '.join(DEFAULT_CACHES)})")
    p.add_argument("--retrieval-caches", nargs="*", type=CacheSpec.parse,
                   default=[CacheSpec.parse(c) for c in DEFAULT_RETRIEVAL_CACHES], metavar="SPEC",
                   help=f"caches for retrieval (none: skip it; default: {' '.join(DEFAULT_RETRIEVAL_CACHES)})")
    p.add_argument("--ppl-docs", type=int, default=4,
                   help="perplexity documents (SmolLM2: the first 4 of ~8000 characters hold 8488 tokens, >= 8192)")
    p.add_argument("--ppl-doc-chars", type=int, default=8000, help="characters per perplexity document")
    p.add_argument("--retrieval-tasks", nargs="+", default=list(DEFAULT_RETRIEVAL_TASKS), choices=RETRIEVAL_TASKS,
                   help="retrieval tasks")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048], help="retrieval context lengths (tokens)")
    p.add_argument("--samples", type=int, default=4, help="prompts per retrieval task and length")
    p.add_argument("--max-gen-toks", type=int, default=16, help="tokens generated per retrieval prompt (RULER: 128)")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per forward pass through the cache")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="output path without suffix (default: docs/results/eval-<model>)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows a previous run with the same settings saved (<out>.partial.json if it was "
                        "interrupted, else <out>.json) and measure only the missing caches and lengths")
    p.add_argument("-v", "--verbose", action="store_true",
                   help=f"log lm-eval's per-row INFO lines too ({', '.join(QUIET_INFO_LOGGERS)}); warnings always show")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison and write <out>.json, <out>.md and <out>.png; returns the report."""
    args = _parser().parse_args(argv)
    command = "python -m eval.compare " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # only lm-eval's per-row INFO lines; every warning of every library still shows
        for name in QUIET_INFO_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    offline_environment()

    import lm_eval
    import torch
    import transformers

    import qcache
    from qcache.tools.models import resolve_model

    from .adapter import QCacheLM

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = resolve_model(args.model)
    out = Path(args.out or f"docs/results/eval-{Path(args.model).name}")
    out.parent.mkdir(parents=True, exist_ok=True)

    start, started, load_before = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S"), load_average()
    settings = {"ppl_docs": args.ppl_docs, "ppl_doc_chars": args.ppl_doc_chars, "chunk_size": args.chunk_size,
                "retrieval_tasks": args.retrieval_tasks, "lengths": args.lengths, "samples": args.samples,
                "max_gen_toks": args.max_gen_toks, "dtype": args.dtype, "device": device}
    checkpoint = Checkpoint(Path(f"{out}.partial.json"), {"model": args.model, **settings}, args.resume,
                            report=Path(f"{out}.json"))
    lm = QCacheLM(pretrained=path, cache="default", chunk_size=args.chunk_size, dtype=args.dtype, device=device,
                  batch_size=1)
    ppl_rows, ppl_tokens = [], None
    if args.caches:
        ppl_rows, ppl_tokens = run_perplexity(lm, args.caches, path, args.ppl_docs, args.ppl_doc_chars, checkpoint)
    retrieval_rows = []
    if args.retrieval_caches:
        retrieval_rows = run_retrieval(lm, args.retrieval_caches, path, args.retrieval_tasks, args.lengths,
                                       args.samples, args.max_gen_toks, checkpoint)
    add_deltas(ppl_rows, retrieval_rows)
    report = {
        "model": args.model, "model_path": path, "command": command, "started": started,
        "seconds_total": time.perf_counter() - start,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {device}, {torch.get_num_threads()} torch threads",
        "load_average": {"start": load_before, "end": load_average()},  # other jobs on the machine: times are noise
        "git": git_state(),
        "versions": {"qcache": qcache.__version__, "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__")
                     else _dist_version("lm_eval"), "transformers": transformers.__version__,
                     "torch": torch.__version__, "python": platform.python_version()},
        "settings": settings, "resumed": checkpoint.resumed,
        "ppl_tokens": ppl_tokens,
        "perplexity": ppl_rows, "retrieval": retrieval_rows,
    }
    Path(f"{out}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    Path(f"{out}.md").write_text(markdown(report))
    plot(report, Path(f"{out}.png"))
    print(markdown(report))
    checkpoint.discard()
    print(f"wrote {out}.json, {out}.md, {out}.png ({report['seconds_total']:.0f} s)")
    return report


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
