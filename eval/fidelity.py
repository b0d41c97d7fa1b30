"""Fidelity of KV caches at the model's full context: KL divergence, top-1 agreement and Δ perplexity against the
default cache, key-value needle margins, and the bits per value each cache holds.

    python -m eval.fidelity                                      # SmolLM2-135M at 8192 tokens (see MODEL_DEFAULTS)
    python -m eval.fidelity --model gemma3-270m                  # Gemma-3-270M
    python -m eval.fidelity --context 1024 --docs 2 --caches default quant:4 hf-quanto:4 --lengths 1024 --needles 8

Fidelity: `--docs` documents of `--context` tokens of the eval split, or with `--text code` of Python sources
(`qcache.tools.data`; the tokenizer's leading special tokens, e.g. Gemma's <bos>, then text; calibration never
reads either) go through the default cache and every cache in
`--caches` in lockstep: each `--chunk` (256) tokens run through the default cache, then through every other cache,
so all see the same tokens. Scored are the predictions made at positions `--score-from` (0.5) x context and later,
where most of each cache is quantized:

    mean KL        KL(default || cache) of the next-token distributions, nats/token
    top-1          share of positions whose argmax equals the default cache's
    Δ PPL          perplexity of the true next tokens vs the default cache's, in %
    spread         per-document min/max, and a 95 % bootstrap interval resampling the scored 256-token chunks
                   (paired: default and cache on the same chunks)

Bits per value held: bytes of every tensor a cache holds at the end of a document (`qcache.tools.footprint.
reachable_bytes`: codes, scales, zeros, outliers, codebooks, positions, full-precision tokens, RoPE tables, ...)
x 8, over the K and V values the default cache holds at that context (every layer and KV head: tokens held x
head_dim x 2; sliding-window layers hold their window). A 16-bit default cache that holds nothing else is 16.0.

Needles (`--lengths`, `--needles` per length, `calibration.needles`): one haystack per length with key-value needles at
depths 5 %-95 %; each cache is filled once per length, then every needle's question + answer runs teacher-forced
through its own copy of the filled cache. Reported per cache and length: the share of needles whose answer tokens
are all the argmax (Wilson 95 % interval; also per depth third), the mean answer log-probability and its mean
difference to the default cache (95 % bootstrap interval over needles).

A cache spec is KIND[:BITS][:OPTION=VALUE,...] as in `eval.compare` (`quant:4`, `quant:2:calibration=auto`,
`hf-quanto:4`); `calibration=auto` calibrates the loaded model for that spec on the calibration split first. The
default cache is always measured (it is the reference). Caches a model refuses (Transformers' quantized caches on
models with sliding-window layers) are recorded as refused rows.

Outputs `<out>.json` (everything: command, git commit and whether the tree was clean, machine, timings, per-chunk
and per-needle numbers), `<out>.md` (tables) and `<out>.png` (KL and Δ PPL vs bits/value held, Pareto front).
Not a test: minutes on a CPU.
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

from calibration.needles import (
    VALUE_KINDS,
    NeedleScore,
    build_needles,
    depth_third,
    fill_cache,
    needle_text,
    question_text,
    score_needles,
    wilson_interval,
)
from .compare import CacheSpec, auto_calibration
from qcache.tools.footprint import reachable_bytes
from .options import MODEL_DTYPES, check_positive_int, chunk_bounds, model_dtype, parse_cache_options
from .provenance import git_state, load_average

__all__ = [
    "MODEL_DEFAULTS",
    "DEFAULT_CACHES",
    "FidelitySettings",
    "RefChunk",
    "reference_chunk",
    "chunk_metrics",
    "values_held",
    "bits_per_value_held",
    "ChunkSums",
    "document_ids",
    "lockstep_document",
    "summarize_fidelity",
    "summarize_needles",
    "pareto_front",
    "CacheEntry",
    "prepare_caches",
    "run_fidelity",
    "run_needles",
    "needle_align",
    "markdown",
    "plot",
    "main",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelDefaults:
    """What `python -m eval.fidelity --model NAME` measures when not told otherwise."""

    context: int
    docs: int
    lengths: tuple[int, ...]
    note: str = ""
    dtype: str = "bfloat16"  # the weights' dtype when --dtype is not given


# sized for about 35 minutes per model with the default caches on 2 nearly idle CPU cores (bf16, measured per cache):
# SmolLM2 ~10.5 min per 8k document (Transformers' HQQ caches ~4 of them: they re-quantize the whole cache at every
# chunk) and ~13 min of needles; Gemma-3 ~10.5 min per 32k document and ~14 min of needles. The eval split holds two
# Gemma documents of 32k tokens.
MODEL_DEFAULTS = {
    "smollm2-135m": ModelDefaults(context=8192, docs=2, lengths=(2048, 4096, 8192),
                                  note="SmolLM2-135M's maximum context"),
    "gemma3-270m": ModelDefaults(context=32768, docs=2, lengths=(8192, 16384, 32768),
                                 note="Gemma-3-270M's maximum context"),
    # fp32 weights: bf16 matmuls are several times slower on CPUs without bf16 units, and a 1.5B model's 16k
    # document takes minutes per cache even in fp32
    "qwen2.5-coder-1.5b": ModelDefaults(context=16384, docs=1, lengths=(4096, 8192, 16384), dtype="float32",
                                        note="half of Qwen2.5-Coder-1.5B's 32768, for the CPU time"),
}
# the calibrated rows: the defaults, with whether keys are rotated too chosen on the calibration split and the file's
# key codebooks where keys stay unrotated (`python -m qcache.calibrate`'s defaults)
DEFAULT_CACHES = ("default", "quant:8", "quant:4", "quant:3", "quant:2", "quant:4:calibration=auto",
                  "quant:3:calibration=auto", "quant:2:calibration=auto", "hf-quanto:4", "hf-quanto:2", "hf-hqq:4",
                  "hf-hqq:2", "hf-fp8")
REFERENCE = "default"
_HF_RESIDUAL = 128  # Transformers' quantized caches keep this many tokens unquantized, then re-quantize everything


def needle_align(chunk: int) -> int:
    """Filled needle contexts are a multiple of this: 128 when `chunk` is a multiple of 128, else `chunk`.

    Then the last piece of the fill is at least 128 tokens, so Transformers' quantized caches re-quantize at the end
    of the fill and hold no residual; a question shorter than 128 tokens then never makes them re-quantize, which HQQ
    cannot do at every length (its bit packing needs kv_heads x tokens x head_dim / 64 to be a multiple of 4).

    Example:
        >>> needle_align(256), needle_align(200)
        (128, 200)
    """
    return _HF_RESIDUAL if chunk % _HF_RESIDUAL == 0 else chunk
_BLOCK = 32  # positions per log-softmax block (262k-token vocabularies: 32 MiB per fp32 block)


@dataclass(frozen=True)
class FidelitySettings:
    """What one run measures (validated; the model-dependent limits are checked by `check_model`).

    Args:
        context: tokens per fidelity document.
        docs: documents.
        chunk: tokens per forward pass through each cache.
        score_from: first scored position as a fraction of `context` (0.5: the second half).
        lengths: needle context lengths (empty: no needles).
        needles: needles per length.
        needle_values: "number" (5 digits) or "word" (`calibration.needles.build_needles`).
        seed: seed of the needles' keys and values and of the bootstrap.
        bootstrap: bootstrap resamples for the intervals.
        dtype: model weights' dtype.

    Example:
        >>> FidelitySettings(context=8192, docs=3, lengths=(2048, 4096, 8192)).scored_per_doc
        4095
    """

    context: int
    docs: int
    chunk: int = 256
    score_from: float = 0.5
    lengths: tuple[int, ...] = ()
    needles: int = 30
    needle_values: str = "number"
    seed: int = 0
    bootstrap: int = 1000
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("context", "docs", "chunk", "needles", "bootstrap"):
            check_positive_int(name, getattr(self, name))
        if not 0.0 <= self.score_from < 1.0:
            raise ValueError(f"score_from={self.score_from!r} must be in [0, 1)")
        if self.scored_per_doc < 1:
            raise ValueError(f"context={self.context} with score_from={self.score_from} scores no position")
        for n in self.lengths:
            check_positive_int("length", n)
        if len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"lengths={list(self.lengths)} repeats a length")
        if self.needle_values not in VALUE_KINDS:
            raise ValueError(f"needle_values={self.needle_values!r} is not supported; allowed values: "
                             f"{list(VALUE_KINDS)}")
        model_dtype(self.dtype)

    @property
    def score_start(self) -> int:
        """First position whose prediction is scored."""
        return int(self.context * self.score_from)

    @property
    def scored_per_doc(self) -> int:
        """Predictions scored per document (the last position has no next token)."""
        return self.context - 1 - self.score_start

    def check_model(self, max_positions: int | None) -> None:
        """Every context fits the model's positions."""
        if max_positions is None:
            return
        for name, n in (("context", self.context), *(("length", x) for x in self.lengths)):
            if n > max_positions:
                raise ValueError(f"{name}={n} exceeds the model's max_position_embeddings={max_positions}")




# ---------------------------------------------------------------------------------------------------------
# Metrics (pure)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class RefChunk:
    """The default cache's side of one scored chunk: log-probabilities [T, V], probabilities [T, V], argmax [T] and
    the NLL of the true next tokens [T] (fp32)."""

    logp: torch.Tensor
    p: torch.Tensor
    top1: torch.Tensor
    nll: torch.Tensor


def reference_chunk(logits: torch.Tensor, targets: torch.Tensor) -> RefChunk:
    """`logits` [T, V] of the default cache and the true next tokens [T] -> RefChunk."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    return RefChunk(logp, logp.exp(), logp.argmax(dim=-1), -logp.gather(1, targets[:, None])[:, 0])


def chunk_metrics(ref: RefChunk, logits: torch.Tensor, targets: torch.Tensor, block: int = _BLOCK
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: KL(default || cache) in nats, top-1 agreement (bool) and the cache's NLL of the true next token.

    `logits` [T, V] come from the cache under test; they are turned into log-probabilities `block` rows at a time
    (a 262k vocabulary makes whole-chunk temporaries large).

    Example:
        >>> ref = reference_chunk(torch.tensor([[2.0, 0.0]]), torch.tensor([0]))
        >>> [float(x) for x in chunk_metrics(ref, torch.tensor([[2.0, 0.0]]), torch.tensor([0]))[:2]]
        [0.0, 1.0]
    """
    if logits.shape != ref.logp.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match the reference {tuple(ref.logp.shape)}")
    kl, agree, nll = [], [], []
    for a in range(0, logits.shape[0], block):
        b = a + block
        logp = torch.log_softmax(logits[a:b].float(), dim=-1)  # [t, V]
        kl.append((ref.p[a:b] * (ref.logp[a:b] - logp)).sum(dim=-1).clamp_min(0.0))
        agree.append(logp.argmax(dim=-1) == ref.top1[a:b])
        nll.append(-logp.gather(1, targets[a:b, None])[:, 0])
    return torch.cat(kl), torch.cat(agree), torch.cat(nll)


def values_held(default_cache) -> int:
    """K and V values the default cache (`transformers.DynamicCache`) holds: per layer, keys and values of shape
    [batch, kv_heads, tokens held, head_dim] (a sliding-window layer holds at most its window)."""
    total = 0
    for i, layer in enumerate(default_cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not (torch.is_tensor(keys) and torch.is_tensor(values)):
            raise ValueError(f"layer {i} of {type(default_cache).__name__} holds no keys/values tensors; "
                             "values_held counts a filled transformers.DynamicCache")
        total += keys.numel() + values.numel()
    return total


def bits_per_value_held(cache, values: int) -> float:
    """Bytes of every tensor reachable from `cache` x 8 / `values` (the values the default cache holds)."""
    check_positive_int("values", values)
    return reachable_bytes(cache) * 8 / values


@dataclass
class ChunkSums:
    """Sums over the scored positions of one chunk (what the bootstrap resamples)."""

    doc: int
    start: int
    n: int
    kl: float
    agree: int
    nll: float
    ref_nll: float


def document_ids(tokenizer, context: int, docs: int, split: str = "eval") -> torch.LongTensor:
    """[docs, context]: the tokenizer's leading special tokens (what `tokenizer(text)` puts first, e.g. <bos>), then
    consecutive windows of `split` ("eval" prose or "code": `qcache.tools.data.token_sequences`)."""
    from qcache.tools.data import token_sequences

    prefix = list(tokenizer("", add_special_tokens=True)["input_ids"])
    if len(prefix) >= context:
        raise ValueError(f"context={context} leaves no room for text after {len(prefix)} special tokens")
    text = token_sequences(tokenizer, split, docs, context - len(prefix))  # [docs, context - P]
    return torch.cat([torch.tensor([prefix] * docs, dtype=torch.long).view(docs, len(prefix)), text], dim=1)


@dataclass
class CacheTrack:
    """One cache's state and results during the lockstep run."""

    label: str
    make: Callable[[], object]
    chunks: list[ChunkSums] = field(default_factory=list)
    bits: list[float] = field(default_factory=list)
    held_bytes: list[int] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0
    error: str | None = None
    cache: object = None
    values: int | None = None  # the reference: K and V values it held at the end of the last document
    key_rotation: dict | None = None  # a QuantCache's per-layer key rotation (rotate="auto" decides it per layer)


def _timed_forward(track: CacheTrack, model, piece: torch.Tensor, keep: int) -> torch.Tensor:
    wall, cpu = time.perf_counter(), time.process_time()
    logits = model(piece, cache=track.cache, use_cache=True, logits_to_keep=keep).logits
    track.wall += time.perf_counter() - wall
    track.cpu += time.process_time() - cpu
    return logits


@torch.no_grad()
def lockstep_document(model, ids: torch.Tensor, doc: int, reference: CacheTrack, candidates: Sequence[CacheTrack],
                      chunk: int, score_start: int, progress=None) -> None:
    """Feed one document `ids` [L] through the reference and every candidate, chunk by chunk; append each chunk's
    sums to the candidates' tracks and the bits held at the end to every track. A candidate that raises is
    marked with its error and dropped (its cache freed); the others go on."""

    device = next(model.parameters()).device
    length = ids.shape[0]
    ids = ids.to(device)
    for track in (reference, *candidates):
        if track.error is None:
            track.cache = track.make()
    for start, end in chunk_bounds(length, chunk):
        first, last = max(start, score_start), min(end, length - 1)  # scored positions: [first, last)
        scored = first < last
        keep = end - first if scored else 1
        piece = ids[None, start:end]  # [1, c]
        ref_logits = _timed_forward(reference, model, piece, keep)[0]  # [keep, V]
        if scored:
            targets = ids[first + 1:last + 1]  # [T]
            ref = reference_chunk(ref_logits[:last - first], targets)
        del ref_logits
        for track in candidates:
            if track.error is not None:
                continue
            try:
                logits = _timed_forward(track, model, piece, keep)[0]
            except (RuntimeError, ValueError, NotImplementedError) as err:
                log.exception("%s failed on document %d at token %d", track.label, doc, start)
                track.error, track.cache = f"{type(err).__name__}: {err}", None
                continue
            if scored:
                kl, agree, nll = chunk_metrics(ref, logits[:last - first], targets)
                track.chunks.append(ChunkSums(doc, start, int(kl.numel()), float(kl.sum()), int(agree.sum()),
                                              float(nll.sum()), float(ref.nll.sum())))
            del logits
        if progress is not None:
            progress.update(1)
    values = values_held(reference.cache)
    for track in (reference, *candidates):
        if track.error is None:
            track.held_bytes.append(reachable_bytes(track.cache))
            track.bits.append(track.held_bytes[-1] * 8 / values)
            if hasattr(track.cache, "key_rotation"):
                track.key_rotation = {str(i): c["rotate"] for i, c in track.cache.key_rotation.items()}
            track.cache = None
    reference.values = values


# ---------------------------------------------------------------------------------------------------------
# Summaries (pure)
# ---------------------------------------------------------------------------------------------------------


def _stats(chunks: Sequence[ChunkSums]) -> dict:
    n = sum(c.n for c in chunks)
    nll, ref_nll = sum(c.nll for c in chunks), sum(c.ref_nll for c in chunks)
    return {"kl": sum(c.kl for c in chunks) / n, "top1": sum(c.agree for c in chunks) / n,
            "ppl": math.exp(nll / n), "ref_ppl": math.exp(ref_nll / n),
            "delta_ppl_pct": 100 * math.expm1((nll - ref_nll) / n), "tokens": n}


def _bootstrap(chunks: Sequence[ChunkSums], resamples: int, seed: int) -> dict:
    """95 % percentile intervals of mean KL, top-1 and Δ PPL, resampling chunks with replacement."""
    import numpy as np

    rng = np.random.default_rng(seed)
    arr = np.array([[c.n, c.kl, c.agree, c.nll - c.ref_nll] for c in chunks], dtype=np.float64)  # [C, 4]
    idx = rng.integers(0, len(chunks), size=(resamples, len(chunks)))  # [B, C]
    sums = arr[idx].sum(axis=1)  # [B, C, 4] -> [B, 4]
    draws = {"kl": sums[:, 1] / sums[:, 0], "top1": sums[:, 2] / sums[:, 0],
             "delta_ppl_pct": 100 * np.expm1(sums[:, 3] / sums[:, 0])}
    return {k: [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] for k, v in draws.items()}


def summarize_fidelity(chunks: Sequence[ChunkSums], resamples: int = 1000, seed: int = 0) -> dict:
    """Pooled KL / top-1 / Δ PPL of one cache, per document, and 95 % bootstrap intervals (chunks resampled).

    Example:
        >>> s = summarize_fidelity([ChunkSums(0, 0, 10, 0.5, 9, 20.0, 19.0), ChunkSums(1, 0, 10, 0.3, 10, 19.0, 19.0)])
        >>> round(s["kl"], 3), s["top1"], [round(d["kl"], 2) for d in s["per_doc"]]
        (0.04, 0.95, [0.05, 0.03])
    """
    if not chunks:
        raise ValueError("no scored chunks to summarize")
    docs = sorted({c.doc for c in chunks})
    per_doc = [{"doc": d, **_stats([c for c in chunks if c.doc == d])} for d in docs]
    return {**_stats(chunks), "per_doc": per_doc, "ci95": _bootstrap(chunks, resamples, seed),
            **{f"{k}_doc_range": [min(p[k] for p in per_doc), max(p[k] for p in per_doc)]
               for k in ("kl", "top1", "delta_ppl_pct")}}


def _mean_ci(values: Sequence[float], resamples: int, seed: int) -> dict:
    import numpy as np

    arr = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, len(arr), size=(resamples, len(arr)))].mean(axis=1)  # [B, N] -> [B]
    return {"mean": float(arr.mean()), "ci95": [float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))]}


def summarize_needles(scores: Sequence[NeedleScore], reference: Sequence[NeedleScore] | None,
                      resamples: int = 1000, seed: int = 0) -> dict:
    """Share found (Wilson 95 %), per depth third, mean log-probability, and the mean difference to the reference's
    log-probability of the same needles (bootstrap 95 % over needles) when a reference is given."""
    found = sum(s.found for s in scores)
    out = {"needles": len(scores), "found": found, "share": found / len(scores),
           "wilson95": list(wilson_interval(found, len(scores))),
           "logprob": _mean_ci([s.logprob for s in scores], resamples, seed),
           "min_margin_mean": sum(s.min_margin for s in scores) / len(scores), "by_third": []}
    for third in range(3):
        part = [s for s in scores if depth_third(s.depth) == third]
        k = sum(s.found for s in part)
        out["by_third"].append({"third": third, "needles": len(part), "found": k,
                                "wilson95": list(wilson_interval(k, len(part))) if part else None})
    if reference is not None:
        ref = {s.key: s for s in reference}
        if set(ref) != {s.key for s in scores}:
            raise ValueError("the reference was scored on other needles")
        out["delta_logprob"] = _mean_ci([s.logprob - ref[s.key].logprob for s in scores], resamples, seed)
        kept = [s.found for s in scores if ref[s.key].found]
        out["kept"] = {"of": len(kept), "found": sum(kept),
                       "wilson95": list(wilson_interval(sum(kept), len(kept))) if kept else None}
    return out


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better), by the first coordinate.

    Example:
        >>> pareto_front([(16, 0.0), (4, 0.1), (4.5, 0.2), (2, 1.0)])
        [3, 1, 0]
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


# ---------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------


@dataclass
class CacheEntry:
    """A cache spec resolved against the loaded model: a factory, or why it cannot be built."""

    spec: CacheSpec
    label: str
    make: Callable[[], object] | None = None
    refused: str | None = None
    calibration_seconds: float | None = None
    options: dict | None = None  # a QuantCache's options as resolved (every default spelled out), for the tables


def prepare_caches(model, tokenizer, specs: Sequence[CacheSpec]) -> list[CacheEntry]:
    """Factories for `specs` (`calibration=auto` calibrated now, through `eval.compare`'s own path); caches the model
    refuses (ValueError, ImportError, NotImplementedError when built) come back with `refused` set."""
    from eval.caches import cache_factory


    entries = []
    for spec in specs:
        entry = CacheEntry(spec, spec.label)
        try:
            start = time.perf_counter()
            options = auto_calibration(model, tokenizer, spec)
            if spec.options.get("calibration") == "auto":
                entry.calibration_seconds = time.perf_counter() - start
            bits, parsed = parse_cache_options(options)
            entry.make = cache_factory(spec.kind, model.config, spec.bits if bits is None else bits, **parsed)
            entry.options = resolved_options(entry.make())
        except (ValueError, ImportError, NotImplementedError) as err:
            log.warning("%s refused: %s", spec.label, err)
            entry.refused = f"{type(err).__name__}: {err}"
        entries.append(entry)
    return entries


def run_fidelity(model, ids: torch.Tensor, entries: Sequence[CacheEntry], settings: FidelitySettings,
                 progress: bool = True) -> list[dict]:
    """Every document through every cache in lockstep; one row per cache (the reference first)."""
    from tqdm.auto import tqdm


    ref_entry = next(e for e in entries if e.spec.kind == REFERENCE)
    reference = CacheTrack(ref_entry.label, ref_entry.make)
    tracks = [CacheTrack(e.label, e.make) for e in entries if e is not ref_entry and e.refused is None]
    values = []
    bar = tqdm(total=ids.shape[0] * len(chunk_bounds(ids.shape[1], settings.chunk)), desc="fidelity",
               disable=not progress, unit="chunk")
    for doc in range(ids.shape[0]):
        bar.set_postfix_str(f"document {doc + 1}/{ids.shape[0]}")
        lockstep_document(model, ids[doc], doc, reference, tracks, settings.chunk, settings.score_start, bar)
        values.append(reference.values)
    bar.close()
    by_label = {t.label: t for t in tracks}
    rows = []
    for e in entries:
        row = {"cache": e.label, "spec": _spec_dict(e.spec), "options": e.options,
               "calibration_seconds": e.calibration_seconds}
        if e.refused is not None:
            rows.append({**row, "refused": e.refused})
            continue
        t = reference if e is ref_entry else by_label[e.label]
        row.update({"bits_per_value": t.bits[-1] if t.bits else None, "held_bytes": t.held_bytes,
                    "values_held": values[-1], "seconds": t.wall, "cpu_seconds": t.cpu})
        if t.key_rotation is not None:  # "kv": keys rotated in that layer, "v": unrotated
            row["key_rotation"] = t.key_rotation
        if t.error is not None:
            rows.append({**row, "error": t.error})
        elif e is ref_entry:
            rows.append({**row, "reference": True})
        else:
            rows.append({**row, **summarize_fidelity(t.chunks, settings.bootstrap, settings.seed),
                         "chunks": [asdict(c) for c in t.chunks]})
    return rows


def run_needles(model, tokenizer, text: str, entries: Sequence[CacheEntry], settings: FidelitySettings,
                progress: bool = True) -> list[dict]:
    """Per length, per cache: fill once, score every needle; one row per cache and length."""
    from tqdm.auto import tqdm


    usable = [e for e in entries if e.refused is None]
    align = needle_align(settings.chunk)
    plans = {n: build_needles(tokenizer, text, n, settings.needles, settings.seed, align=align,
                              values=settings.needle_values) for n in settings.lengths}
    total = sum(len(usable) * (len(chunk_bounds(ids.shape[1], settings.chunk)) + len(needles))
                for ids, needles in plans.values())
    bar = tqdm(total=total, desc="needles", disable=not progress, unit="step")
    rows = []
    for length, (fill_ids, needles) in plans.items():
        ref_scores = None
        for e in entries:
            row = {"cache": e.label, "spec": _spec_dict(e.spec), "options": e.options, "length": length,
                   "filled_tokens": fill_ids.shape[1]}
            if e.refused is not None:
                rows.append({**row, "refused": e.refused})
                continue
            bar.set_postfix_str(f"{e.label} @ {length}")
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                cache = fill_cache(model, e.make(), fill_ids, settings.chunk)
                bar.update(len(chunk_bounds(fill_ids.shape[1], settings.chunk)))
                fill_seconds = time.perf_counter() - wall
                held = reachable_bytes(cache)
                scores = []
                for needle in needles:
                    scores.extend(score_needles(model, cache, [needle]))
                    bar.update(1)
            except (RuntimeError, ValueError, NotImplementedError) as err:
                log.exception("%s failed on the needles at %d", e.label, length)
                rows.append({**row, "error": f"{type(err).__name__}: {err}"})
                continue
            if e.spec.kind == REFERENCE:
                ref_scores, values = scores, values_held(cache)
            del cache
            rows.append({**row, "held_bytes": held, "seconds": time.perf_counter() - wall, "fill_seconds": fill_seconds,
                         "cpu_seconds": time.process_time() - cpu,
                         "scores": [asdict(s) for s in scores], "_scores": scores})
        for row in rows:
            if row["length"] != length or "_scores" not in row:
                continue
            scores = row.pop("_scores")
            row["bits_per_value"] = row["held_bytes"] * 8 / values if ref_scores is not None else None
            row.update(summarize_needles(scores, None if row["cache"] == REFERENCE or ref_scores is None
                                         else ref_scores, settings.bootstrap, settings.seed))
    bar.close()
    return rows


def resolved_options(cache) -> dict | None:
    """The options a QuantCache runs with, every default resolved (`QuantCacheConfig.to_dict`); None for other
    caches. Result files keep them so that a row says what it measured whatever the defaults are later."""
    options = getattr(cache, "options", None)
    return options.to_dict() if hasattr(options, "to_dict") else None


def _spec_dict(spec: CacheSpec) -> dict:
    return {"kind": spec.kind, "bits": spec.bits, "options": dict(spec.options)}


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def _f(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)


def _ci(pair, spec: str) -> str:
    return f"[{_f(pair[0], spec)}, {_f(pair[1], spec)}]" if pair else "n/a"


def _pct(x) -> str:
    return _f(100 * x if x is not None else None, ".1f")


def _fidelity_section(report: dict) -> list[str]:
    s = report["settings"]
    rows = report["fidelity"]
    ref = next(r for r in rows if r.get("reference"))
    lines = [
        "", f"## Fidelity: {s['docs']} documents x {s['context']} tokens of "
        + ("Python sources (the split 'code': the standard library's own files)" if report.get("text") == "code"
           else "prose (the eval split)"),
        "", f"Scored: the predictions at positions {s['score_start']}..{s['context'] - 2} of each document "
        f"({s['scored_per_doc']} per document, {s['scored_per_doc'] * s['docs']} in all), where most of each cache "
        f"is quantized. Fed {s['chunk']} tokens at a time; every cache saw the same tokens as the default cache. "
        "Intervals: 95 % bootstrap over the scored chunks (paired); per-document range in brackets after it.",
        "", f"Bits/value held: bytes of every tensor a cache holds at the end of a document x 8, over the "
        f"{ref['values_held']:,} K and V values the default cache holds at {s['context']} tokens; the default "
        f"cache measures {_f(ref['bits_per_value'], '.2f')}." + _default_bits_note(ref),
        "", "| cache | bits/value held | mean KL (nats/token) [95 %] | KL per doc | top-1 agreement % [95 %] | "
            "Δ PPL % [95 %] | Δ PPL per doc | time vs default |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "refused" in r or "error" in r:
            why = r.get("refused") or r["error"]
            lines.append(f"| {r['cache']} | {'refused' if 'refused' in r else 'failed'}: {why[:120]} | | | | | | |")
        elif r.get("reference"):
            lines.append(f"| {r['cache']} | {_f(r['bits_per_value'], '.2f')} | 0 (reference) | | 100 | "
                         f"PPL {_f(report['reference_ppl'], '.3f')} | | 1.00 |")
        else:
            lines.append(
                f"| {r['cache']} | {_f(r['bits_per_value'], '.2f')} | {_f(r['kl'], '.3g')} "
                f"{_ci(r['ci95']['kl'], '.3g')} | {_ci(r['kl_doc_range'], '.3g')} | {_pct(r['top1'])} "
                f"[{_pct(r['ci95']['top1'][0])}, {_pct(r['ci95']['top1'][1])}] | {_f(r['delta_ppl_pct'], '+.2f')} "
                f"{_ci(r['ci95']['delta_ppl_pct'], '+.2f')} | {_ci(r['delta_ppl_pct_doc_range'], '+.2f')} | "
                f"{_f(r['seconds'] / ref['seconds'] if ref['seconds'] else None, '.2f')} |")
    return lines


def _default_bits_note(ref: dict) -> str:
    bits = ref.get("bits_per_value")
    if bits is None or abs(bits - 16.0) < 1e-9:
        return " (exactly 16.0: it holds its bf16 keys and values and nothing else)."
    return (f" Not 16.0: the default cache holds {ref['held_bytes'][-1] - 2 * ref['values_held']:,} bytes beyond "
            "its keys and values (e.g. Transformers' sliding-window layers keep their window as a view of the last "
            "concatenation, whose storage is larger than the window); the other caches are counted the same way.")


def _needle_section(report: dict) -> list[str]:
    s = report["settings"]
    example = needle_text("zephyr", "48213" if s["needle_values"] == "number" else "pineapple", s["needle_values"])
    lines = ["", f"## Needles: {s['needles']} key-value needles per length, depths 5-95 %",
             "", f"Needles like `{example.strip()}` in eval-split text (one key and {s['needle_values']} each); "
             f"question `{question_text('zephyr', s['needle_values'])}`".replace("\n", "\\n")
             + ", then the answer, scored teacher-forced. "
             "Each cache is filled once per length with the haystack (needles inside), then every needle's "
             "question + answer runs teacher-forced through its own copy of the filled cache. Found: every answer "
             "token is the argmax (Wilson 95 % interval). Δ log-prob: mean over needles of the answer's "
             "log-probability minus the default cache's (bootstrap 95 %). Kept: of the needles the default cache "
             "finds, how many this cache finds. Bits/value held: after the fill, over the default cache's values."]
    for length in s["lengths"]:
        rows = [r for r in report["needles"] if r["length"] == length]
        filled = rows[0]["filled_tokens"] if rows else "?"
        lines += ["", f"### {length} tokens ({filled} in the filled context, the rest question + answer)", "",
                  "| cache | bits/value held | found % [Wilson 95 %] | first / middle / last third | "
                  "mean answer log-prob | Δ log-prob [95 %] | kept |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if "refused" in r or "error" in r:
                why = r.get("refused") or r["error"]
                lines.append(f"| {r['cache']} | {'refused' if 'refused' in r else 'failed'}: {why[:120]} | | | | | |")
                continue
            thirds = " / ".join(f"{t['found']}/{t['needles']}" for t in r["by_third"])
            delta = (f"{_f(r['delta_logprob']['mean'], '+.3f')} {_ci(r['delta_logprob']['ci95'], '+.3f')}"
                     if "delta_logprob" in r else "(reference)")
            kept = f"{r['kept']['found']}/{r['kept']['of']}" if "kept" in r else ""
            lines.append(f"| {r['cache']} | {_f(r['bits_per_value'], '.2f')} | {_pct(r['share'])} "
                         f"[{_pct(r['wilson95'][0])}, {_pct(r['wilson95'][1])}] | {thirds} | "
                         f"{_f(r['logprob']['mean'], '.3f')} | {delta} | {kept} |")
    return lines


def markdown(report: dict) -> str:
    """The report's tables."""
    s, t = report["settings"], report["timings"]
    git = report.get("git")
    git_text = ("not a git checkout" if not git else f"git {git['commit'][:10]}"
                + (" with uncommitted changes" if git["dirty"] else " (clean tree)"))
    lines = [
        f"# KV-cache fidelity: {report['model']} at {s['context']} tokens", "",
        f"Command: `{report['command']}`", "",
        f"{report['started']}; {t['total']:.0f} s in all (fidelity {t['fidelity']:.0f} s, needles "
        f"{t['needles']:.0f} s, calibration {t['calibration']:.0f} s, loading {t['load']:.0f} s) on "
        f"{report['machine']}, load average {report['load_average']['start']} at the start, "
        f"{report['load_average']['end']} at the end; {git_text}; " + ", ".join(
            f"{k} {v}" for k, v in report["versions"].items()) + f"; weights {s['dtype']}.", "",
        f"Context: {s['context']} tokens ({report['context_note']}). Quality is measured against the default cache "
        "(DynamicCache) in the same run, on the same tokens. Times are noise on shared machines; the JSON has them "
        "per cache.",
    ]
    if report["fidelity"]:
        lines += _fidelity_section(report)
    if report["needles"]:
        lines += _needle_section(report)
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Mean KL and Δ PPL against bits/value held: every cache a point (95 % bootstrap bars), the Pareto front drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["fidelity"] if "kl" in r and r.get("bits_per_value") is not None]
    ref = next((r for r in report["fidelity"] if r.get("reference")), None)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, ylabel, yscale in ((axes[0], "kl", "mean KL(default || cache), nats/token", "log"),
                                    (axes[1], "delta_ppl_pct", "Δ perplexity vs default (%)", "symlog")):
        pts = [(r["bits_per_value"], r[key]) for r in rows]
        if ref is not None and ref.get("bits_per_value") is not None:
            ax.axvline(ref["bits_per_value"], color="gray", lw=0.8, ls=":")
            ax.annotate("default", (ref["bits_per_value"], 0.5), xycoords=("data", "axes fraction"), rotation=90,
                        fontsize=8, color="gray", ha="right")
        for r, (x, y) in zip(rows, pts, strict=True):
            lo, hi = r["ci95"][key]
            ax.errorbar(x, y, yerr=[[max(y - lo, 0)], [max(hi - y, 0)]], fmt="o", ms=4, capsize=2,
                        color="C0" if r["spec"]["kind"] == "quant" else "C1")
            ax.annotate(r["cache"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        candidates = list(pts)
        if key == "delta_ppl_pct" and ref is not None and ref.get("bits_per_value") is not None:
            candidates.append((ref["bits_per_value"], 0.0))  # the default cache: Δ PPL 0 by definition
            ax.plot(*candidates[-1], marker="s", color="gray", ms=5)
        front = pareto_front(candidates)
        if front:
            fx, fy = zip(*(candidates[i] for i in front), strict=True)
            ax.step(fx, fy, where="post", color="C2", lw=1, label="Pareto front")
        if yscale == "log" and any(y > 0 for _, y in pts):
            ax.set_yscale("log")
        elif yscale == "symlog":
            ax.set_yscale("symlog", linthresh=0.1)
            ax.axhline(0, color="gray", lw=0.8)
        ax.set_xlabel("bits per value held (default cache: its own count)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8, handles=[*ax.get_legend_handles_labels()[0],
                                       plt.Line2D([], [], marker="o", ls="", color="C0", label="qcache"),
                                       plt.Line2D([], [], marker="o", ls="", color="C1", label="Transformers")])
    s = report["settings"]
    fig.suptitle(f"{report['model']}: {s['docs']} x {s['context']} tokens, scored from {s['score_start']}, "
                 "vs the default cache of the same run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval.fidelity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help=f"short name ({', '.join(sorted(MODEL_DEFAULTS))}) or local HF directory")
    p.add_argument("--context", type=int, default=None,
                   help="tokens per fidelity document (default: per model, " + ", ".join(
                       f"{k} {v.context}" for k, v in MODEL_DEFAULTS.items()) + ")")
    p.add_argument("--docs", type=int, default=None, help="fidelity documents (default: per model, " + ", ".join(
        f"{k} {v.docs}" for k, v in MODEL_DEFAULTS.items()) + ")")
    p.add_argument("--caches", nargs="*", type=CacheSpec.parse, default=None, metavar="SPEC",
                   help=f"caches for the fidelity part, KIND[:BITS][:OPTION=VALUE,...]; the default cache is always "
                        f"measured; given with no SPEC: skip the fidelity part (default: {' '.join(DEFAULT_CACHES)})")
    p.add_argument("--needle-caches", nargs="*", type=CacheSpec.parse, default=None, metavar="SPEC",
                   help="caches for the needles (default: the same as --caches, or the default list when --caches "
                        "is given empty; given with no SPEC: skip the needles)")
    p.add_argument("--lengths", nargs="*", type=int, default=None,
                   help="needle context lengths in tokens (default: per model, " + ", ".join(
                       f"{k} {' '.join(map(str, v.lengths))}" for k, v in MODEL_DEFAULTS.items()) + ")")
    p.add_argument("--needles", type=int, default=30, help="needles per length (default 30)")
    p.add_argument("--needle-values", default="number", choices=VALUE_KINDS,
                   help="what the needles' answers are: 5-digit numbers or words (default: number)")
    p.add_argument("--text", default="eval", choices=["eval", "code"],
                   help="fidelity documents: the eval split's prose or Python standard-library sources (default: "
                        "eval; the needles' haystacks stay prose)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per forward pass through each cache")
    p.add_argument("--score-from", type=float, default=0.5,
                   help="first scored position as a fraction of the context (default 0.5: the second half)")
    p.add_argument("--dtype", default=None, choices=sorted(MODEL_DTYPES),
                   help="model weights' dtype (default: per model, " + ", ".join(
                       f"{k} {v.dtype}" for k, v in MODEL_DEFAULTS.items()) + ")")
    p.add_argument("--seed", type=int, default=0, help="seed of the needles and the bootstrap")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="output path without suffix (default: docs/results/fidelity-<model>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _with_reference(specs: Sequence[CacheSpec]) -> list[CacheSpec]:
    """The default cache first (the reference), then the others in order; repeated labels are an error."""
    specs = list(specs)
    labels = [s.label for s in specs]
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ValueError(f"caches {repeated} are listed more than once")
    ref = [s for s in specs if s.kind == REFERENCE]
    return (ref or [CacheSpec(REFERENCE)]) + [s for s in specs if s.kind != REFERENCE]


def resolve_args(args: argparse.Namespace) -> tuple[FidelitySettings, list[CacheSpec], list[CacheSpec], str]:
    """Settings and cache lists from parsed arguments, with the per-model defaults; raises ValueError on bad input."""
    name = Path(args.model).name
    defaults = MODEL_DEFAULTS.get(name)
    missing = [flag for flag, value in (("--context", args.context), ("--docs", args.docs), ("--lengths", args.lengths))
               if value is None]
    if defaults is None and missing:
        raise ValueError(f"model {args.model!r} has no defaults (known: {sorted(MODEL_DEFAULTS)}); pass "
                         + ", ".join(missing))
    context = args.context if args.context is not None else defaults.context
    note = defaults.note if defaults is not None and args.context is None else "set on the command line"
    settings = FidelitySettings(
        context=context, docs=args.docs if args.docs is not None else defaults.docs, chunk=args.chunk,
        score_from=args.score_from, lengths=tuple(args.lengths if args.lengths is not None else defaults.lengths),
        needles=args.needles, needle_values=args.needle_values, seed=args.seed, bootstrap=args.bootstrap,
        dtype=args.dtype or (defaults.dtype if defaults is not None else "bfloat16"))
    default_list = [CacheSpec.parse(c) for c in DEFAULT_CACHES]
    caches = args.caches if args.caches is not None else default_list
    needle_caches = args.needle_caches if args.needle_caches is not None else (caches or default_list)
    if args.threads is not None:
        check_positive_int("threads", args.threads)
    return settings, (_with_reference(caches) if caches else []), \
        (_with_reference(needle_caches) if needle_caches and settings.lengths else []), note


def main(argv: list[str] | None = None) -> dict:
    """Run the measurement and write <out>.json, <out>.md and <out>.png; returns the report."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        settings, caches, needle_caches, note = resolve_args(args)
    except ValueError as err:
        parser.error(str(err))
    command = "python -m eval.fidelity " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("transformers", "lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)

    import transformers

    import qcache
    from qcache.tools.data import read_split, sha256_of_split
    from qcache.tools.models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    t0, started, load_before = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S"), load_average()
    model, tokenizer = load_model(args.model, dtype=model_dtype(settings.dtype))
    text_config = model.config.get_text_config(decoder=True)
    try:
        settings.check_model(getattr(text_config, "max_position_embeddings", None))
    except ValueError as err:
        parser.error(str(err))
    timings = {"load": time.perf_counter() - t0}
    out = Path(args.out or f"docs/results/fidelity-{Path(args.model).name}")
    out.parent.mkdir(parents=True, exist_ok=True)

    t = time.perf_counter()
    by_label = {e.label: e for e in prepare_caches(model, tokenizer, _unique(caches + needle_caches))}
    timings["calibration"] = time.perf_counter() - t
    fidelity_rows, needle_rows, ref_ppl = [], [], None
    t = time.perf_counter()
    if caches:
        ids = document_ids(tokenizer, settings.context, settings.docs, args.text)
        fidelity_rows = run_fidelity(model, ids, [by_label[s.label] for s in caches], settings,
                                     progress=not args.no_progress)
        scored = [r for r in fidelity_rows if "ref_ppl" in r]
        ref_ppl = scored[0]["ref_ppl"] if scored else None
    timings["fidelity"] = time.perf_counter() - t
    t = time.perf_counter()
    if needle_caches:
        needle_rows = run_needles(model, tokenizer, read_split("eval"), [by_label[s.label] for s in needle_caches],
                                  settings, progress=not args.no_progress)
    timings["needles"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - t0
    report = {
        "model": args.model, "command": command, "started": started, "timings": timings,
        "cpu_seconds": time.process_time(),
        "machine": describe_machine(),
        "load_average": {"start": load_before, "end": load_average()}, "git": git_state(),
        "versions": {"qcache": qcache.__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__, "python": platform.python_version()},
        "settings": {**asdict(settings), "lengths": list(settings.lengths), "score_start": settings.score_start,
                     "scored_per_doc": settings.scored_per_doc},
        "context_note": note, "eval_sha256": sha256_of_split("eval"), "text": args.text,
        "text_sha256": sha256_of_split(args.text), "reference_ppl": ref_ppl,
        "fidelity": fidelity_rows, "needles": needle_rows,
    }
    Path(f"{out}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    Path(f"{out}.md").write_text(markdown(report))
    if fidelity_rows:
        plot(report, Path(f"{out}.png"))
    print(markdown(report))
    print(f"wrote {out}.json, {out}.md" + (f", {out}.png" if fidelity_rows else "")
          + f"; total time {timings['total']:.0f} s")
    return report


def describe_machine() -> str:
    """CPU model, cores, memory and torch threads (what the timings ran on)."""
    model, memory = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                     model)
        kib = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal")))
        memory = f", {kib / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{model}, {os.cpu_count()} CPUs{memory}, {torch.get_num_threads()} torch threads"


def _unique(specs: Sequence[CacheSpec]) -> list[CacheSpec]:
    seen, out = set(), []
    for s in specs:
        if s.label not in seen:
            seen.add(s.label)
            out.append(s)
    return out


if __name__ == "__main__":
    main()
