"""Which QuantCache width a model can afford at a context: memory from the sizing formula, quality measured.

    python -m eval.doctor --model smollm2-135m --context 8192 --budget-gib 4
    python -m eval.doctor --model path/to/model_dir --context 4096 --quick
    python -m eval.doctor --model gemma3-270m --context 32768 --docs 1 --needles 20

For the model and the context N it reports, per width (8/4/3/2 bits by default, `--bits`):

    memory       bytes/token and GiB at N from `qcache.tools.size` (the same formula as `python -m qcache.size`), next to
                 the bytes the cache measurably held at the end of an N-token document; with `--budget-gib`, how
                 many N-token sequences fit
    fidelity     KL(default || cache), top-1 agreement and Δ perplexity vs the default cache on `--docs` documents
                 of N tokens of the eval text (`eval.fidelity`: lockstep, the second half scored, 95 % bootstrap)
    needles      `--needles` key-value needles in one N-token haystack (`calibration.needles`): share found (Wilson 95 %),
                 the mean needle margin (log p(answer token) - the best other token's, the minimum over the answer;
                 > 0: found) and the mean Δ answer log-prob vs the default cache (95 % bootstrap)
    attention    which attention implementation the model runs, what the code says about its accumulator, and a
                 probe: one query over N keys with equal scores in the model's dtype must give mean(V) (a bf16
                 running sum of more than 256 equal weights stops growing, so a low-precision accumulator fails it)

and the smallest setting that keeps the needles: the width with the fewest bytes per token whose needle share is not
below the default cache's Wilson 95 % interval (measured in the same run, on the same needles). Outputs `<out>.json`,
`<out>.md` and `<out>.png` (default `docs/results/doctor-<model>-<N>`). Needs `qcache[eval]` (the fidelity runner
lives in `eval/`); every model-dependent number is measured in the run, on this machine.

Cost: every cache is filled twice (a fidelity document, the haystack). On one thread (the default: on 2 shared
cores, 2 OpenMP threads made a chunked fill up to 20x slower, measured), a fill of 8192 tokens of SmolLM2-135M took
38 s through the default cache and 44 s through QuantCache, a needle 0.5 s, so the defaults (2 documents, 30 needles,
4 widths) take about 11-12 minutes at 8192 tokens; `--quick` (1 document, 10 needles, 200 bootstrap resamples) about
7. Time grows with N (attention) and with the number of widths (`--bits`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from qcache.config import SUPPORTED_BITS

from .options import MODEL_DTYPES, check_positive_int, model_dtype

__all__ = [
    "DOCTOR_BITS",
    "ATTENTION_IMPLEMENTATIONS",
    "ACCUMULATION",
    "DoctorSettings",
    "size_rows",
    "attention_module",
    "probe_accumulation",
    "attention_report",
    "width_rows",
    "keeps_needles",
    "choose_setting",
    "diagnose",
    "markdown",
    "plot",
    "main",
]

logger = logging.getLogger(__name__)

DOCTOR_BITS = tuple(sorted(SUPPORTED_BITS, reverse=True))  # (8, 4, 3, 2)
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "qcache_fp32")
# a running sum of equal terms rounded to the dtype after each addition stops growing at 2**(significant bits) terms
_STALL_TERMS = {torch.bfloat16: 256, torch.float16: 2048}
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
REFERENCE = "default"

# What each implementation's code does with a low-precision model (qcache/attention.py's docstring has the detail,
# read from torch 2.13 / transformers 5.24 and measured there)
ACCUMULATION = {
    "qcache_fp32": ("yes, by construction", "q/k/v are upcast to fp32 and torch SDPA runs on fp32 inputs: scores, "
                    "softmax and P @ V in fp32, probabilities not rounded; the output is cast back"),
    "sdpa": ("on CPU, as an accident of the kernel", "the CPU flash kernel keeps scores, max, sum and the output in "
             "fp32 (probabilities rounded to the model dtype before P @ V); the math kernel upcasts to fp32 unless the "
             "process-wide torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp flag allows bf16. Which kernel "
             "runs, that flag and the device decide: nothing in the API promises fp32"),
    "eager": ("depends on the BLAS library", "softmax in fp32, then rounded to the model dtype; P @ V is a matmul "
              "in the model dtype whose accumulator is the BLAS library's choice (oneDNN/MKL accumulate in fp32 on "
              "CPU; cuBLAS may reduce in bf16: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction "
              "defaults to True)"),
}


@dataclass(frozen=True)
class DoctorSettings:
    """What one doctor run measures (validated here; the model-dependent limits by `check_model`).

    Args:
        context: N, tokens of every fidelity document and of the needle haystack (question and answer included).
        bits: the QuantCache widths measured (each in 2, 3, 4, 8), with default options otherwise.
        budget_gib: KV-cache memory budget in GiB (None: no budget column).
        docs: fidelity documents of N tokens.
        needles: needles in the haystack.
        chunk: tokens per forward pass through each cache.
        bootstrap: bootstrap resamples of the intervals.
        seed: seed of the needles and the bootstrap.
        dtype: model weights' dtype.
        attn_implementation: the attention the model runs (None: what transformers picks for it).

    Example:
        >>> DoctorSettings(context=8192, bits=(4, 2)).labels
        ['quant-4bit', 'quant-2bit']
    """

    context: int
    bits: tuple[int, ...] = DOCTOR_BITS
    budget_gib: float | None = None
    docs: int = 2
    needles: int = 30
    chunk: int = 256
    bootstrap: int = 1000
    seed: int = 0
    dtype: str = "bfloat16"
    attn_implementation: str | None = None

    def __post_init__(self) -> None:
        for name in ("context", "docs", "needles", "chunk", "bootstrap"):
            check_positive_int(name, getattr(self, name))
        if not self.bits:
            raise ValueError(f"bits=() measures nothing; allowed values: {list(DOCTOR_BITS)}")
        for b in self.bits:
            if b not in DOCTOR_BITS:
                raise ValueError(f"bits={b!r} is not supported; allowed values: {list(DOCTOR_BITS)}")
        if len(set(self.bits)) != len(self.bits):
            raise ValueError(f"bits={list(self.bits)} repeats a width")
        if self.budget_gib is not None and (isinstance(self.budget_gib, bool) or not isinstance(
                self.budget_gib, (int, float)) or not math.isfinite(self.budget_gib) or self.budget_gib <= 0):
            raise ValueError(f"budget_gib={self.budget_gib!r} must be a positive number")
        model_dtype(self.dtype)
        if self.attn_implementation not in (None, *ATTENTION_IMPLEMENTATIONS):
            raise ValueError(f"attn_implementation={self.attn_implementation!r} is not supported; allowed values: "
                             f"{list(ATTENTION_IMPLEMENTATIONS)}")

    @property
    def labels(self) -> list[str]:
        """Row labels of the widths, as `eval.caches.cache_label` writes them."""
        from .caches import cache_label

        return [cache_label("quant", b) for b in self.bits]

    def fidelity_settings(self):
        """The same measurement as `eval.fidelity.FidelitySettings` (needles at N only)."""
        from eval.fidelity import FidelitySettings

        return FidelitySettings(context=self.context, docs=self.docs, chunk=self.chunk, lengths=(self.context,),
                                needles=self.needles, seed=self.seed, bootstrap=self.bootstrap, dtype=self.dtype)

    def check_model(self, max_positions: int | None) -> None:
        """N fits the model's positions."""
        if max_positions is not None and self.context > max_positions:
            raise ValueError(f"context={self.context} exceeds the model's max_position_embeddings={max_positions}")


# ---------------------------------------------------------------------------------------------------------------
# Memory (the sizing formula of qcache.tools.size)
# ---------------------------------------------------------------------------------------------------------------


def size_rows(geometry, context: int, bits: Sequence[int], budget_gib: float | None = None) -> list[dict]:
    """`qcache.tools.size.size_table` rows for the 16-bit default cache and QuantCache at `bits`, at `context` tokens
    (requests of `context` tokens counted against `budget_gib`, when given), each with its `setting` label.

    Example:
        >>> from qcache.tools.size import Geometry
        >>> [r["setting"] for r in size_rows(Geometry(30, 3, 64), 8192, (4, 2))]
        ['default', 'quant-4bit', 'quant-2bit']
    """
    from .caches import cache_label
    from qcache.tools.size import GIB, QCACHE_FORMATS, size_table

    formats = ["16-bit"] + [f for f, b in QCACHE_FORMATS.items() if b in bits]
    budget = (budget_gib or 0) * GIB
    rows = size_table(geometry, context, budget_bytes=budget, request_tokens=context, formats=formats)
    for row in rows:
        row["setting"] = REFERENCE if row["format"] == "16-bit" else cache_label("quant", QCACHE_FORMATS[row["format"]])
        if budget_gib is None:
            row.pop("requests_that_fit")
        else:
            row["fits_budget"] = row["gib_at_context"] <= budget_gib
    order = {cache_label("quant", b): i for i, b in enumerate(bits)}
    return [rows[0]] + sorted(rows[1:], key=lambda r: order[r["setting"]])


# ---------------------------------------------------------------------------------------------------------------
# Attention: which implementation, and does it accumulate in fp32
# ---------------------------------------------------------------------------------------------------------------


def attention_module(model) -> torch.nn.Module:
    """The model's first attention module (an `nn.Module` with `layer_idx`, `config` and `num_key_value_groups`,
    what transformers' attention functions read)."""
    for module in model.modules():
        if all(hasattr(module, a) for a in ("layer_idx", "config", "num_key_value_groups")):
            return module
    raise ValueError(f"{type(model).__name__} has no attention module with layer_idx, config and "
                     "num_key_value_groups: the doctor cannot probe its attention")


def _attention_function(module, implementation: str) -> Callable:
    """What `module`'s forward calls for `implementation` (transformers' AttentionInterface; eager: the function of
    the module's own modeling file)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if implementation == "eager":
        if eager is None:
            raise ValueError(f"{type(module).__module__} has no eager_attention_forward to probe")
        return eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)


def probe_accumulation(fn: Callable, module, keys: int, dtype: torch.dtype, q_heads: int, kv_heads: int,
                       head_dim: int, seed: int = 0) -> dict:
    """Flat attention through `fn` (a transformers attention function): one query over `keys` keys that all score
    the same, values in [1, 2), in `dtype`. The output must be mean(V); its largest relative error is compared with
    what fp32 accumulation allows: `tolerance` = 2u (u: the unit roundoff of `dtype`, the output's rounding) +
    4 sqrt(keys) 2**-24 (an fp32 sum of `keys` terms; measured: about 0.7 sqrt(keys) 2**-24).

    verdict: "fp32" (error <= tolerance), "low precision" (error > tolerance: a bf16 running sum of n > 256 equal
    weights loses 1 - 256/n of the mass), or "undetermined" (error within tolerance, but a low-precision running
    sum of `keys` equal terms would not have stalled yet: `keys` <= 256 in bf16, <= 2048 in fp16).

    Example:
        >>> from qcache.attention import fp32_sdpa_attention_forward
        >>> m = torch.nn.Module(); m.num_key_value_groups, m.is_causal = 2, True
        >>> probe_accumulation(fp32_sdpa_attention_forward, m, 4096, torch.bfloat16, 2, 1, 64)["verdict"]
        'fp32'
    """
    check_positive_int("keys", keys)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, q_heads, 1, head_dim, generator=gen).to(dtype)  # [B, Hq, 1, D]
    k = torch.randn(1, kv_heads, 1, head_dim, generator=gen).to(dtype).expand(1, kv_heads, keys, head_dim)  # equal
    v = (1.0 + torch.rand(1, kv_heads, keys, head_dim, generator=gen)).to(dtype)  # [B, Hkv, n, D]
    with torch.no_grad():
        out, _ = fn(module, q, k.contiguous(), v, None, dropout=0.0, scaling=head_dim ** -0.5)
    out = out.reshape(1, 1, q_heads, head_dim)  # [B, Tq, Hq, D], as attention functions return it
    expected = v.double().mean(dim=2)  # [B, Hkv, D]
    expected = expected.repeat_interleave(q_heads // kv_heads, dim=1)  # [B, Hq, D]: query head h reads kv h // n_rep
    rel = float(((out[:, 0].double() - expected).abs() / expected).max())
    u = _UNIT_ROUNDOFF[dtype]
    tolerance = 2 * u + 4 * math.sqrt(keys) * _UNIT_ROUNDOFF[torch.float32]
    if rel > tolerance:
        verdict = "low precision"
    elif dtype in _STALL_TERMS and keys <= _STALL_TERMS[dtype]:
        verdict = "undetermined"
    else:
        verdict = "fp32"
    return {"keys": keys, "dtype": str(dtype).removeprefix("torch."), "max_rel_error": rel, "unit_roundoff": u,
            "tolerance": tolerance, "verdict": verdict}


def attention_report(model, keys: int) -> dict:
    """The implementation `model` runs, what its code does (`ACCUMULATION`) and the flat-attention probe at `keys`
    keys in the model's dtype (`probe_accumulation`)."""
    implementation = getattr(model.config, "_attn_implementation", None)
    dtype = next(model.parameters()).dtype
    module = attention_module(model)
    text = model.config.get_text_config(decoder=True)
    q_heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or q_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // q_heads)
    fp32, how = ACCUMULATION.get(implementation, ("not described here", "see the probe"))
    if dtype == torch.float32:
        fp32, how = "yes (the model runs in float32)", f"{how}; in a float32 model every step is float32 anyway"
    report = {"implementation": implementation, "model_dtype": str(dtype).removeprefix("torch."),
              "fp32_accumulation": fp32, "how": how}
    try:
        report["probe"] = probe_accumulation(_attention_function(module, implementation), module, keys, dtype,
                                             q_heads, kv_heads, head_dim)
    except (KeyError, ValueError, RuntimeError, TypeError) as err:
        report["probe"] = {"error": f"{type(err).__name__}: {err}"}
    return report


# ---------------------------------------------------------------------------------------------------------------
# Per width, and the choice (pure)
# ---------------------------------------------------------------------------------------------------------------


def keeps_needles(row: dict, reference: dict) -> bool:
    """A needle row keeps the needles when its share found is not below the reference's Wilson 95 % interval.

    Example:
        >>> ref = {"wilson95": [0.886, 1.0]}
        >>> keeps_needles({"share": 0.9}, ref), keeps_needles({"share": 0.8}, ref)
        (True, False)
    """
    return row.get("share") is not None and row["share"] >= reference["wilson95"][0]


def width_rows(sizes: Sequence[dict], fidelity: Sequence[dict], needles: Sequence[dict]) -> list[dict]:
    """One row per setting (the default cache first): the formula's memory, the bytes held in the fidelity run, KL /
    top-1 / Δ PPL and the needles, from the rows of `size_rows`, `eval.fidelity.run_fidelity` and `run_needles`."""
    fid = {r["cache"]: r for r in fidelity}
    ndl = {r["cache"]: r for r in needles}
    ref_needles = ndl.get(REFERENCE)
    if ref_needles is not None and "share" not in ref_needles:
        raise ValueError(f"the default cache's needle run failed: {ref_needles.get('error')}")
    out = []
    for size in sizes:
        label = size["setting"]
        row = {"setting": label, "bytes_per_token": size["bytes_per_token"], "gib_at_context": size["gib_at_context"]}
        for key in ("requests_that_fit", "fits_budget"):
            if key in size:
                row[key] = size[key]
        f = fid.get(label)
        if f is not None:
            for key in ("error", "refused"):
                if key in f:
                    row[f"fidelity_{key}"] = f[key]
            if f.get("held_bytes"):
                row["held_bytes_per_token"] = f["held_bytes"][-1] / size["context"]
                row["bits_per_value"] = f["bits_per_value"]
            if "kl" in f:
                row.update({"kl": f["kl"], "top1": f["top1"], "delta_ppl_pct": f["delta_ppl_pct"], "ci95": f["ci95"]})
        n = ndl.get(label)
        if n is not None:
            for key in ("error", "refused"):
                if key in n:
                    row[f"needles_{key}"] = n[key]
            if "share" in n:
                row["needles"] = {k: n[k] for k in ("needles", "found", "share", "wilson95", "min_margin_mean",
                                                    "logprob", "delta_logprob", "kept") if k in n}
                if ref_needles is not None:
                    row["keeps_needles"] = keeps_needles(n, ref_needles)
        out.append(row)
    return out


def choose_setting(rows: Sequence[dict]) -> dict:
    """The setting with the fewest bytes per token (the formula's) among those that keep the needles
    (`keeps_needles`), from `width_rows`; `setting` None when no width keeps them.

    Example:
        >>> rows = [{"setting": "default", "bytes_per_token": 4.0, "needles": {"share": 1.0, "wilson95": [0.8, 1.0]}},
        ...         {"setting": "quant-4bit", "bytes_per_token": 1.0, "keeps_needles": True},
        ...         {"setting": "quant-2bit", "bytes_per_token": 0.5, "keeps_needles": False}]
        >>> choose_setting(rows)["setting"]
        'quant-4bit'
    """
    ref = next((r for r in rows if r["setting"] == REFERENCE), None)
    if ref is None or "needles" not in ref:
        raise ValueError("choose_setting needs the default cache's needle row (the interval to stay within)")
    lo, hi = ref["needles"]["wilson95"]
    candidates = sorted((r for r in rows if r["setting"] != REFERENCE), key=lambda r: r["bytes_per_token"])
    kept = [r["setting"] for r in candidates if r.get("keeps_needles")]
    criterion = (f"needle share found not below the default cache's Wilson 95 % interval "
                 f"[{100 * lo:.1f} %, {100 * hi:.1f} %]")
    if not kept:
        return {"setting": None, "criterion": criterion, "keeping": [],
                "reason": "no measured width keeps the needles: keep the default cache (or calibrate)"}
    best = next(r for r in candidates if r["setting"] == kept[0])
    out = {"setting": best["setting"], "criterion": criterion, "keeping": kept,
           "bytes_per_token": best["bytes_per_token"], "gib_at_context": best.get("gib_at_context"),
           "reason": f"the fewest bytes per token of the widths that keep the needles ({', '.join(kept)})"}
    smaller_failed = [r["setting"] for r in candidates if r["bytes_per_token"] < best["bytes_per_token"]]
    larger_failed = [r["setting"] for r in candidates
                     if r["bytes_per_token"] > best["bytes_per_token"] and not r.get("keeps_needles")]
    notes = []
    if ref["needles"]["share"] == 0:
        notes.append("the default cache finds none of the needles, so every width keeps them trivially: the needles "
                     "cannot tell the widths apart on this model at this context (KL and top-1 still can)")
    if larger_failed:
        notes.append(f"{', '.join(larger_failed)} did not keep the needles although {best['setting']} did: the "
                     "needle counts are noisy at this sample size; more --needles would tell")
    if notes:
        out["note"] = "; ".join(notes)
    out["smaller_failed"] = smaller_failed
    if "fits_budget" in best:
        out["fits_budget"] = best["fits_budget"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Timer:
    seconds: dict = field(default_factory=dict)

    def __call__(self, name: str, start: float) -> None:
        self.seconds[name] = time.perf_counter() - start


def diagnose(model, tokenizer, settings: DoctorSettings, progress: bool = True) -> dict:
    """Everything the doctor reports for a loaded `model` (see the module docstring), as a dict.

    Raises ValueError when the context does not fit the model or the needles do not fit the context."""
    try:
        from eval.compare import CacheSpec
        from eval.fidelity import document_ids, needle_align, prepare_caches, run_fidelity, run_needles
        from calibration.needles import build_needles
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(f"python -m eval.doctor runs the fidelity runner of eval/ ({err}); "
                          "pip install 'qcache[eval]'") from err
    from qcache.tools.data import read_split
    from qcache.tools.size import Geometry

    text_config = model.config.get_text_config(decoder=True)
    settings.check_model(getattr(text_config, "max_position_embeddings", None))
    fsettings = settings.fidelity_settings()
    geometry = Geometry.from_config(model.config)
    timer = _Timer()

    start = time.perf_counter()
    attention = attention_report(model, settings.context)
    timer("attention probe", start)
    haystack = read_split("eval")
    # the needles run_needles will place: fail now, not after the fidelity part, if they do not fit in N
    build_needles(tokenizer, haystack, settings.context, settings.needles, settings.seed,
                  align=needle_align(settings.chunk))
    specs = [CacheSpec(REFERENCE)] + [CacheSpec("quant", b) for b in settings.bits]
    entries = prepare_caches(model, tokenizer, specs)
    refused = [e for e in entries if e.refused is not None]
    if any(e.spec.kind == REFERENCE for e in refused):
        raise ValueError(f"the default cache cannot be built for this model: {refused[0].refused}")

    start = time.perf_counter()
    ids = document_ids(tokenizer, settings.context, settings.docs)  # [docs, N]
    fidelity = run_fidelity(model, ids, entries, fsettings, progress=progress)
    timer("fidelity", start)
    start = time.perf_counter()
    needles = run_needles(model, tokenizer, haystack, entries, fsettings, progress=progress)
    timer("needles", start)

    sizes = size_rows(geometry, settings.context, settings.bits, settings.budget_gib)
    rows = width_rows(sizes, fidelity, needles)
    return {
        "settings": {**asdict(settings), "bits": list(settings.bits), "score_start": fsettings.score_start,
                     "scored_per_doc": fsettings.scored_per_doc},
        "geometry": {**asdict(geometry), "describe": geometry.describe()},
        "attention": attention, "size": sizes, "rows": rows, "choice": choose_setting(rows),
        "fidelity": fidelity, "needles": needles, "timings": timer.seconds,
    }


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def _f(value, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _ci(pair, spec: str, scale: float = 1.0) -> str:
    return f"[{_f(pair[0] * scale, spec)}, {_f(pair[1] * scale, spec)}]" if pair else ""


def _quality_cells(r: dict) -> list[str]:
    if r["setting"] == REFERENCE:
        return ["0 (reference)", "100", "0 (reference)"]
    if "kl" not in r:
        why = r.get("fidelity_error") or r.get("fidelity_refused") or "not measured"
        return [f"failed: {why[:80]}", "", ""]
    return [f"{_f(r['kl'], '.3g')} {_ci(r['ci95']['kl'], '.3g')}",
            f"{_f(100 * r['top1'], '.1f')} {_ci(r['ci95']['top1'], '.1f', 100)}",
            f"{_f(r['delta_ppl_pct'], '+.2f')} {_ci(r['ci95']['delta_ppl_pct'], '+.2f')}"]


def _needle_cells(r: dict) -> list[str]:
    n = r.get("needles")
    if n is None:
        why = r.get("needles_error") or r.get("needles_refused") or "not measured"
        return [f"failed: {why[:80]}", "", "", ""]
    delta = (f"{_f(n['delta_logprob']['mean'], '+.3f')} {_ci(n['delta_logprob']['ci95'], '+.3f')}"
             if "delta_logprob" in n else "(reference)")
    keeps = "" if r["setting"] == REFERENCE else ("yes" if r.get("keeps_needles") else "**no**")
    return [f"{n['found']}/{n['needles']} {_ci(n['wilson95'], '.0f', 100)} %", _f(n["min_margin_mean"], "+.2f"), delta,
            keeps]


def _git_note(report: dict) -> str:
    git = report.get("git")
    if not git:
        return "not run from a git checkout"
    return f"git {git['commit'][:10]} ({'uncommitted changes' if git['dirty'] else 'clean tree'})"


def markdown(report: dict) -> str:
    """The report as markdown: memory, attention, quality per width, the choice."""
    s, a, c = report["settings"], report["attention"], report["choice"]
    N = s["context"]
    budget = s["budget_gib"]
    lines = [f"# qcache doctor: {report['model']} at {N} tokens", "", f"Command: `{report['command']}`", "",
             f"{report['started']}; {report['timings']['total']:.0f} s in all (" + ", ".join(
                 f"{k} {v:.0f} s" for k, v in report["timings"].items() if k != "total") + f") on {report['machine']}; "
             + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + f"; weights {s['dtype']}; {_git_note(report)}.",
             "",
             f"Model: {report['geometry']['describe']}. Every quality number is measured in this run against the "
             "default cache (DynamicCache) on the same tokens; QuantCache at default options otherwise.", "",
             "## Memory", "",
             f"bytes/token and GiB at {N}: `qcache.tools.size` (the formula of `python -m qcache.size`, averaged over the "
             f"context); held: the bytes every tensor of the cache held at the end of a {N}-token document in this "
             "run (`qcache.tools.footprint`; includes reserved capacity and the RoPE helper the formula leaves out).", "",
             "| setting | bytes/token (formula) | GiB at N (formula) | bytes/token held here | bits/value held |"
             + (f" sequences of {N} in {budget:g} GiB |" if budget is not None else ""),
             "|---|---:|---:|---:|---:|" + ("---:|" if budget is not None else "")]
    for r in report["rows"]:
        lines.append(f"| {r['setting']} | {_f(r['bytes_per_token'], ',.0f')} | {_f(r['gib_at_context'], '.4g')} | "
                     f"{_f(r.get('held_bytes_per_token'), ',.0f')} | {_f(r.get('bits_per_value'), '.2f')} |"
                     + (f" {r['requests_that_fit']} |" if budget is not None else ""))
    probe = a["probe"]
    probe_text = (f"probe failed: {probe['error']}" if "error" in probe else
                  f"one query over {probe['keys']} keys with equal scores in {probe['dtype']}: max relative error "
                  f"{probe['max_rel_error']:.2e}, fp32 accumulation allows {probe['tolerance']:.2e} (2x the output's "
                  "rounding "
                  f"{probe['unit_roundoff']:.1e} + an fp32 sum of {probe['keys']} terms) -> "
                  f"**{probe['verdict']}**")
    lines += ["", "## Attention", "",
              f"The model runs `{a['implementation']}` in {a['model_dtype']}. Accumulates in fp32: "
              f"**{a['fp32_accumulation']}** ({a['how']}).", "",
              f"Measured here ({probe_text}). `attn_implementation=\"qcache_fp32\"` (after `import qcache`) makes fp32 "
              "a property of the code.",
              "", f"## Quality at {N} tokens", "",
              f"Fidelity: {s['docs']} document(s) x {N} tokens of the eval text, predictions from position "
              f"{s['score_start']} on scored ({s['scored_per_doc']} per document); 95 % bootstrap over "
              f"{s['chunk']}-token chunks. Needles: {s['needles']} key-value needles at depths 5-95 % of one "
              f"{N}-token haystack, teacher-forced; found: every answer token is the argmax (Wilson 95 %); "
              "margin: mean over needles of the smallest log-prob margin of an answer token over the best other "
              "token (> 0: found).", "",
              "| setting | mean KL (nats/token) [95 %] | top-1 % [95 %] | Δ PPL % [95 %] | "
              "needles found [Wilson 95 %] | needle margin | Δ answer log-prob [95 %] | keeps the needles |",
              "|---|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in report["rows"]:
        lines.append("| " + " | ".join([r["setting"], *_quality_cells(r), *_needle_cells(r)]) + " |")
    lines += ["", "## Smallest setting that keeps the needles", "", f"Criterion: {c['criterion']}.", ""]
    if c["setting"] is None:
        lines.append(f"**None**: {c['reason']}.")
    else:
        fits = ""
        if "fits_budget" in c:
            fits = (f"; it {'fits' if c['fits_budget'] else 'does **not** fit'} the {budget:g} GiB budget at {N} "
                    "tokens")
        lines.append(f"**{c['setting']}**: {_f(c['bytes_per_token'], ',.0f')} bytes/token, "
                     f"{_f(c['gib_at_context'], '.4g')} GiB at {N} tokens; {c['reason']}{fits}.")
        if c.get("note"):
            lines += ["", f"Note: {c['note']}."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Three panels: GiB at N per setting (budget line), mean KL vs bits/value held, needles found per setting with
    the default cache's Wilson interval as a band."""
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the doctor's plot needs matplotlib: pip install matplotlib (or 'qcache[eval]')") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, s, choice = report["rows"], report["settings"], report["choice"]
    labels = [r["setting"] for r in rows]
    colors = ["C2" if r["setting"] == choice["setting"] else ("gray" if r["setting"] == REFERENCE else "C0")
              for r in rows]
    fig, (ax_mem, ax_kl, ax_n) = plt.subplots(1, 3, figsize=(15, 4.6))
    ax_mem.bar(labels, [r["gib_at_context"] for r in rows], color=colors)
    ax_mem.tick_params(axis="x", labelrotation=20)
    if s["budget_gib"] is not None:
        ax_mem.axhline(s["budget_gib"], color="C3", ls="--", lw=1, label=f"budget {s['budget_gib']:g} GiB")
        ax_mem.legend(fontsize=8)
    ax_mem.set_ylabel(f"GiB at {s['context']} tokens (qcache.tools.size formula)")
    ax_mem.set_title("KV cache of one sequence", fontsize=10)

    measured = [r for r in rows if "kl" in r and r.get("bits_per_value") is not None]
    for r in measured:
        lo, hi = r["ci95"]["kl"]
        ax_kl.errorbar(r["bits_per_value"], r["kl"], yerr=[[max(r["kl"] - lo, 0)], [max(hi - r["kl"], 0)]], fmt="o",
                       capsize=3, color="C2" if r["setting"] == choice["setting"] else "C0")
        ax_kl.annotate(f"{r['setting']} (top-1 {100 * r['top1']:.1f} %)", (r["bits_per_value"], r["kl"]), fontsize=7,
                       xytext=(3, 3), textcoords="offset points")
    if any(r["kl"] > 0 for r in measured):
        ax_kl.set_yscale("log")
    ax_kl.set_xlabel("bits per value held")
    ax_kl.set_ylabel("mean KL(default || cache), nats/token")
    ax_kl.set_title(f"fidelity: {s['docs']} x {s['context']} tokens", fontsize=10)

    ref = next(r for r in rows if r["setting"] == REFERENCE)
    if "needles" in ref:
        lo, hi = ref["needles"]["wilson95"]
        ax_n.axhspan(100 * lo, 100 * hi, color="gray", alpha=0.25, label="default cache, Wilson 95 %")
    for i, r in enumerate(rows):
        n = r.get("needles")
        if n is None:
            continue
        lo, hi = n["wilson95"]
        share = 100 * n["share"]
        ax_n.errorbar(i, share, yerr=[[share - 100 * lo], [100 * hi - share]], fmt="o", capsize=3, color=colors[i])
    ax_n.set_xticks(range(len(rows)), labels, rotation=20)
    ax_n.set_ylim(-5, 105)
    ax_n.set_ylabel("needles found (%)")
    ax_n.set_title(f"{s['needles']} needles in {s['context']} tokens; chosen: {choice['setting'] or 'none'}",
                   fontsize=10)
    ax_n.legend(fontsize=8, loc="lower left")
    fig.suptitle(f"qcache doctor: {report['model']} at {s['context']} tokens", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

QUICK = {"docs": 1, "needles": 10, "bootstrap": 200}
FULL = {"docs": DoctorSettings.docs, "needles": DoctorSettings.needles, "bootstrap": DoctorSettings.bootstrap}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="short model name (smollm2-135m, gemma3-270m) or a local Hugging Face model directory")
    p.add_argument("--context", type=int, default=None,
                   help="N, the context measured, in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--budget-gib", type=float, default=None, help="KV-cache memory budget in GiB (optional)")
    p.add_argument("--bits", type=int, nargs="+", choices=DOCTOR_BITS, default=list(DOCTOR_BITS),
                   help="QuantCache widths to measure (default: 8 4 3 2)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smaller run: {QUICK['docs']} document, {QUICK['needles']} needles, {QUICK['bootstrap']} "
                        "bootstrap resamples (explicit --docs / --needles still win)")
    p.add_argument("--docs", type=int, default=None, help=f"fidelity documents of N tokens (default {FULL['docs']})")
    p.add_argument("--needles", type=int, default=None, help=f"needles in the haystack (default {FULL['needles']})")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward pass through each cache (default 256)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(MODEL_DTYPES), help="model weights' dtype")
    p.add_argument("--attn-implementation", default=None, choices=ATTENTION_IMPLEMENTATIONS,
                   help="attention the model runs (default: what transformers picks, sdpa for most models)")
    p.add_argument("--seed", type=int, default=0, help="seed of the needles and the bootstrap")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on shared cores more threads wait on each other)")
    p.add_argument("--out", default=None, help="output path without suffix (default: docs/results/doctor-<model>-<N>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _settings(args: argparse.Namespace, context: int) -> DoctorSettings:
    base = QUICK if args.quick else FULL
    return DoctorSettings(
        context=context, bits=tuple(args.bits), budget_gib=args.budget_gib,
        docs=args.docs if args.docs is not None else base["docs"],
        needles=args.needles if args.needles is not None else base["needles"], chunk=args.chunk,
        bootstrap=base["bootstrap"], seed=args.seed, dtype=args.dtype, attn_implementation=args.attn_implementation)


def main(argv: Sequence[str] | None = None) -> dict:
    """Measure, print the report, write <out>.json, <out>.md and <out>.png; returns the report."""
    parser = _parser()
    args = parser.parse_args(argv)
    from qcache.tools.size import load_config, resolve_config_source

    try:
        check_positive_int("threads", args.threads)
        path = resolve_config_source(args.model)  # a known name or an existing directory; refused otherwise
        config = load_config(path)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        max_positions = getattr(text, "max_position_embeddings", None)
        context = args.context if args.context is not None else max_positions
        if context is None:
            raise ValueError(f"{args.model!r} has no max_position_embeddings: pass --context")
        settings = _settings(args, context)
        settings.check_model(max_positions)
    except ValueError as err:
        parser.error(str(err))
    command = "python -m eval.doctor " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.WARNING)

    import transformers

    from qcache import __version__
    from qcache.tools.models import load_model

    torch.set_num_threads(args.threads)
    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
    model, tokenizer = load_model(str(path), dtype=model_dtype(settings.dtype),
                                  attn_implementation=settings.attn_implementation)
    load_seconds = time.perf_counter() - t0
    try:
        result = diagnose(model, tokenizer, settings, progress=not args.no_progress)
    except ValueError as err:
        parser.error(str(err))
    result["timings"] = {"load": load_seconds, **result["timings"], "total": time.perf_counter() - t0}
    try:
        from eval.provenance import git_state
        git = git_state()
    except ImportError:  # pragma: no cover - diagnose already needed eval
        git = None
    report = {
        "model": args.model, "command": command, "started": started, "git": git,
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads",
        "versions": {"qcache": __version__, "transformers": transformers.__version__, "torch": torch.__version__},
        **result,
    }
    out = Path(args.out or f"docs/results/doctor-{Path(args.model).name}-{settings.context}")
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    text_report = markdown(report)
    Path(f"{out}.md").write_text(text_report)
    plot(report, Path(f"{out}.png"))
    print(text_report)
    print(f"wrote {out}.json, {out}.md, {out}.png; {report['timings']['total']:.0f} s")
    return report


if __name__ == "__main__":
    main()
