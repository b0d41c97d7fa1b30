"""Speed benchmark: decode tokens/s at fixed contexts, prefill time, bytes held per token and peak RSS of a long
generation, for the default cache, QuantCache 8/4/2 bits and Transformers' quanto/HQQ 4-bit caches; every speed as
a ratio to DynamicCache measured in the same run. Also: what fp32-accumulating attention
("qcache_fp32", qcache/attention.py) costs, whether stock attention accumulates in fp32, and a torch.profiler
breakdown of QuantCache's decode step.

    python bench/bench_speed.py        # SmolLM2-135M bf16, ~16 min on 2 busy shared cores -> docs/results/speed.{json,md}
    python bench/bench_speed.py --contexts 1024 2048 --prefill-contexts 512 --rss-context 2048 \\
        --out docs/results/speed-quick     # a few minutes

Method (batch 1, greedy):
  * decode: for each context L, one DynamicCache is filled by a chunked prefill of L tokens of eval text, and every
    row's cache is filled by replaying those keys/values through its `update()` (one call per layer, as a prefill
    does); then rounds of decode steps run row after row (interleaved, so load drift hits all rows alike). The
    median step time gives tokens/s; the mean is reported too (it includes periodic flushes).
  * prefill: a forward of L tokens into a fresh cache (`logits_to_keep=1`), rows interleaved, median of repeats.
  * peak RSS: one child process per row runs `generate` on `--rss-context` tokens; its peak RSS (VmHWM, reset after
    the model is loaded) minus the RSS before `generate`. glibc's malloc keeps freed heap memory mapped, which made
    identical runs differ by up to 80 MiB; by default the children run with MALLOC_MMAP_THRESHOLD_=131072 so the peak
    measures live tensors (`--rss-malloc glibc` for the default allocator). The child also times the prefill and
    decode steps of that generation (rows run one after another: noisier than the interleaved measurements).
  * threads: 1 by default; on 2 cores shared with other jobs, 2 OpenMP threads were up to 10x slower (measured).

Not a test: it takes minutes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from qcache import QuantCache, __version__
from qcache.layers import BlockLayer
from qcache.attention import ATTN_IMPLEMENTATION, fp32_sdpa_attention_forward, use_fp32_attention
from eval.caches import build_cache
from eval.fidelity import describe_machine
from qcache.tools.data import token_sequences
from qcache.tools.footprint import reachable_bytes
from qcache.tools.models import load_model

log = logging.getLogger("bench_speed")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ATTENTIONS = {"sdpa": "sdpa", "fp32": ATTN_IMPLEMENTATION}  # row suffix -> attn_implementation
# quant rows without a kernel option use the row's kernel="auto" (compiled where torch.compile works); kernel=eager rows
# show what the eager read costs (labelled "+eager")
DEFAULT_ROWS = ["default", "default@fp32", "quant:8", "quant:4", "quant:4@fp32", "quant:4:kernel=eager",
                "quant:4:kernel=eager@fp32",
                "quant:2", "hf-quanto:4", "hf-quanto:4@fp32"]
DEFAULT_RSS_ROWS = ["default", "quant:8", "quant:4", "quant:2", "hf-quanto:4", "hf-hqq:4"]
BASE = "default"  # the row every ratio is taken against: DynamicCache with stock sdpa


# ---------------------------------------------------------------------------------------------------------------
# rows: a cache kind, its bits and the attention implementation
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One benchmarked configuration: a cache spec (`qcache.tools.spec`: `KIND[:BITS][:NAME=VALUE,...]`) and, after
    `@`, how the model attends (`sdpa` when left out, `fp32` for qcache's fp32 attention), e.g.
    `quant:4:kernel=eager@fp32`."""

    kind: str
    bits: int | None = None
    attn: str = "sdpa"
    options: tuple = ()  # (name, typed value) pairs, QuantCacheConfig fields (quant rows only)

    @classmethod
    def parse(cls, spec: str) -> "Row":
        from eval.caches import CACHE_KINDS
        from qcache.tools.spec import parse_spec, typed_options

        body, _, attn = spec.partition("@")
        attn = attn or "sdpa"
        if attn not in ATTENTIONS:
            raise ValueError(f"row {spec!r}: attention {attn!r} is not supported; allowed: {list(ATTENTIONS)}")
        kind, bits, options = parse_spec(body, CACHE_KINDS)
        if options and kind != "quant":
            raise ValueError(f"row {spec!r}: options {sorted(options)} apply to quant rows only")
        return cls(kind, bits, attn, tuple(typed_options(options).items()))

    @property
    def spec(self) -> str:
        bits = "" if self.bits is None else str(self.bits)
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        body = self.kind + (f":{bits}" if bits or opts else "") + (f":{opts}" if opts else "")
        return body + ("" if self.attn == "sdpa" else f"@{self.attn}")

    @property
    def kernel(self) -> str | None:
        """QuantCacheConfig.kernel this row asks for; None: the row's own."""
        return dict(self.options).get("kernel")

    @property
    def label(self) -> str:
        name = self.kind if self.bits is None else f"{self.kind}-{self.bits}bit"
        name += "".join(f"+{v}" if k == "kernel" else f"+{k}={v}" for k, v in self.options)
        return name if self.attn == "sdpa" else f"{name}@{self.attn}"

    def make_cache(self, config):
        return build_cache(self.kind, config, self.bits, **dict(self.options))

    def apply_attention(self, model) -> None:
        if self.attn == "sdpa":
            model.set_attn_implementation("sdpa")
        else:
            use_fp32_attention(model)


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------

def cache_bytes(cache) -> int:
    """Bytes a cache holds: every tensor reachable from it (qcache.tools.footprint), for QuantCache and peers alike."""
    return reachable_bytes(cache)


def replay(src, dst, length: int, model):
    """Fill `dst` with the first `length` cached tokens of DynamicCache `src`: one `update` per layer, as a prefill.
    Each call has `model`'s attention module of that layer as a local up its call stack, as in a real forward, so a
    cache that decides from the weights (rotate="auto", qcache/binding.py) decides as it would there."""
    modules = {m.layer_idx: m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")}
    pos = torch.arange(length).unsqueeze(0)  # [1, L]
    for i, layer in enumerate(src.layers):
        attention = modules.get(i)  # noqa: F841  (read from this frame by the cache)
        k, v = layer.keys[:, :, :length], layer.values[:, :, :length]  # [B, H, L, D]
        dst.update(k.contiguous(), v.contiguous(), i, kwargs={"position_ids": pos})
    return dst


@torch.no_grad()
def decode_step(model, cache, token: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One greedy decode step: (seconds, next token [1, 1])."""
    t0 = time.perf_counter()
    logits = model(token, cache=cache, use_cache=True).logits
    nxt = logits[:, -1:].argmax(-1)
    return time.perf_counter() - t0, nxt


def _rss_kib(field: str) -> int:
    """VmRSS / VmHWM of this process in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _git_state() -> str:
    """HEAD commit and the qcache files changed since (the code measured, on a repository edited concurrently)."""
    def git(*cmd: str) -> str:
        proc = subprocess.run(["git", *cmd], capture_output=True, text=True, check=False,
                              cwd=Path(__file__).resolve().parent.parent)
        return proc.stdout.rstrip("\n") if proc.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    dirty = git("status", "--porcelain", "--", "qcache").splitlines()
    return head + (f" + uncommitted: {', '.join(line[3:] for line in dirty)}" if dirty else "")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


# ---------------------------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------------------------

def measure_accumulation(n: int, head_dim: int = 64) -> dict:
    """Flat attention (one query, n keys, equal scores, values in [1, 2)) in bf16: max relative error of the output
    vs mean(V) for stock SDPA (flash and math kernels), eager's matmul and qcache_fp32; and a bf16 running sum."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, head_dim, generator=gen).bfloat16()
    k = torch.randn(1, 1, 1, head_dim, generator=gen).bfloat16().expand(1, 1, n, head_dim).contiguous()
    v = (1.0 + torch.rand(1, 1, n, head_dim, generator=gen)).bfloat16()
    ref = v.double().mean(dim=2, keepdim=True)  # [1, 1, 1, D]

    def err(out: torch.Tensor) -> float:
        return float(((out.double().reshape(ref.shape) - ref).abs() / ref).max())

    out = {}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out["stock sdpa (CPU flash kernel)"] = err(F.scaled_dot_product_attention(q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out["stock sdpa (math kernel)"] = err(F.scaled_dot_product_attention(q, k, v))
    probs = torch.softmax((q @ k.transpose(-1, -2)).float() * head_dim ** -0.5, dim=-1).bfloat16()
    out["eager (bf16 softmax weights @ V)"] = err(probs @ v)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 1, True
    out["qcache_fp32"] = err(fp32_sdpa_attention_forward(module, q, k, v, None)[0])
    s, w = torch.zeros((), dtype=torch.bfloat16), torch.tensor(1.0 / n, dtype=torch.bfloat16)
    for _ in range(n):  # sequential bf16 running sum of the n weights (stops changing after 256 terms)
        if s + w == s:
            break
        s = s + w
    out["bf16 running sum of the weights (mass kept)"] = float(s)
    return {"n": n, "head_dim": head_dim, "max_rel_error": out, "bf16_unit_roundoff": 2.0 ** -8}


def measure_prefill(model, ids, rows: list[Row], contexts: list[int], repeats: int) -> list[dict]:
    results = []
    for L in contexts:
        times = {r.label: [] for r in rows}
        for row in rows:  # warm-up (untimed): one-time compiles of the compiled read happen here, not in the timing
            row.apply_attention(model)
            with torch.no_grad():
                model(ids[:, :min(L, 512)], cache=row.make_cache(model.config), use_cache=True, logits_to_keep=1)
        for _ in tqdm(range(repeats), desc=f"prefill {L}", leave=False):
            for row in rows:  # interleaved
                row.apply_attention(model)
                cache = row.make_cache(model.config)
                gc.collect()
                with torch.no_grad():
                    t0 = time.perf_counter()
                    model(ids[:, :L], cache=cache, use_cache=True, logits_to_keep=1)
                    times[row.label].append(time.perf_counter() - t0)
                del cache
        base = statistics.median(times[BASE])
        for row in rows:
            med = statistics.median(times[row.label])
            results.append({"row": row.label, "context": L, "seconds_median": med, "seconds": times[row.label],
                            "speed_vs_default": base / med})
            log.info("prefill %5d %-22s %.2f s (%.2fx default)", L, row.label, med, base / med)
    model.set_attn_implementation("sdpa")
    return results


class _Regions:
    """Wraps qcache's cache internals in torch.profiler record_function ranges while profiling (restored after)."""

    TARGETS = [("qcache.layers", "BlockLayer", "update"), ("qcache.layers", "BlockLayer", "_flush"),
               ("qcache.layers", "BlockLayer", "read"), ("qcache.layers", "BlockLayer", "decode_attention"),
               ("qcache.rope", "RopeHelper", "redo"), ("qcache.rope", "RopeHelper", "cos_sin")]

    def __enter__(self):
        import importlib

        from torch.profiler import record_function

        self.saved = []
        for module, cls_name, name in self.TARGETS:
            cls = getattr(importlib.import_module(module), cls_name)
            fn = getattr(cls, name)

            def wrapped(*a, _fn=fn, _tag=f"{cls_name}.{name}", **kw):
                with record_function(_tag):
                    return _fn(*a, **kw)

            self.saved.append((cls, name, fn))
            setattr(cls, name, wrapped)
        return self

    def __exit__(self, *exc):
        for cls, name, fn in self.saved:
            setattr(cls, name, fn)


def profile_decode(model, row: Row, cache, token, steps: int, top: int) -> dict:
    """torch.profiler over `steps` decode steps: top aten ops by self time and qcache regions, in ms per step."""
    from torch.profiler import ProfilerActivity, profile

    row.apply_attention(model)
    with _Regions(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            _, token = decode_step(model, cache, token)
        wall = (time.perf_counter() - t0) / steps
    averages = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in averages)
    ops = sorted((e for e in averages if not e.key.startswith(("BlockLayer.", "RopeHelper."))),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    regions = {e.key: e for e in averages if e.key.startswith(("BlockLayer.", "RopeHelper."))}
    model.set_attn_implementation("sdpa")
    return {
        "row": row.label, "context": cache.get_seq_length(), "steps": steps, "wall_ms_per_step": 1e3 * wall,
        "profiled_ms_per_step": total_self / 1e3 / steps,
        "top_ops": [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                     "calls_per_step": e.count / steps, "pct": 100 * e.self_cpu_time_total / total_self} for e in ops],
        "regions": [{"region": k, "ms_per_step": e.cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps}
                    for k, e in sorted(regions.items(), key=lambda kv: -kv[1].cpu_time_total)],
        "attention_ms_per_step": sum(e.cpu_time_total for e in averages
                                     if e.key == "aten::scaled_dot_product_attention") / 1e3 / steps,
    }


def measure_decode(model, ids, rows: list[Row], contexts: list[int], rounds: int, steps: int, chunk: int,
                   profile_rows: list[Row], profile_steps: int, top: int) -> tuple[list[dict], list[dict]]:
    from transformers import DynamicCache

    results, profiles = [], []
    # no config: every layer keeps every token (a sliding-window layer of DynamicCache(config=...) keeps only its
    # window, which could not be replayed into a fresh cache at the right positions); the model's masks apply the
    # window either way, and each row's own cache (DynamicCache(config=...) for `default`) keeps what it keeps
    ref = DynamicCache()
    model.set_attn_implementation("sdpa")
    filled = 0
    for L in sorted(contexts):
        with torch.no_grad():  # extend the reference cache to L tokens (chunked prefill)
            for start in tqdm(range(filled, L, chunk), desc=f"fill {L}", leave=False):
                out = model(ids[:, start:min(start + chunk, L)], cache=ref, use_cache=True, logits_to_keep=1)
        filled = L
        first = out.logits[:, -1:].argmax(-1)  # [1, 1]
        caches, tokens, times, nbytes = {}, {}, {}, {}
        for row in rows:
            caches[row.label] = replay(ref, row.make_cache(model.config), L, model)
            nbytes[row.label] = cache_bytes(caches[row.label])
            row.apply_attention(model)
            _, tokens[row.label] = decode_step(model, caches[row.label], first)  # warm-up, untimed
            times[row.label] = []
        for _ in tqdm(range(rounds), desc=f"decode {L}", leave=False):
            for row in rows:  # interleaved
                row.apply_attention(model)
                for _ in range(steps):
                    dt, tokens[row.label] = decode_step(model, caches[row.label], tokens[row.label])
                    times[row.label].append(dt)
        base = statistics.median(times[BASE])
        for row in rows:
            med = statistics.median(times[row.label])
            results.append({
                "row": row.label, "context": L, "step_ms_median": 1e3 * med,
                "step_ms_mean": 1e3 * statistics.fmean(times[row.label]), "tokens_per_s": 1.0 / med,
                "speed_vs_default": base / med, "bytes_held": nbytes[row.label],
                "bytes_per_token": nbytes[row.label] / L,
                "layers_keys_rotated": (sum(bool(r["rotated"]) for r in caches[row.label].key_rotation.values())
                                        if hasattr(caches[row.label], "key_rotation") else None),
                "step_ms": [round(1e3 * t, 2) for t in times[row.label]],
            })
            log.info("decode %5d %-22s %7.1f ms/step (%.2fx default), %.0f B/token", L, row.label, 1e3 * med,
                     base / med, nbytes[row.label] / L)
        if L == max(contexts):
            for row in profile_rows:
                profiles.append(profile_decode(model, row, caches[row.label], tokens[row.label], profile_steps, top))
        del caches
        gc.collect()
    model.set_attn_implementation("sdpa")
    return results, profiles


def _flush_state(cache) -> tuple[int, int]:
    """(tokens per flush period, tokens to add before the next single token triggers a flush) of the first layer
    that quantizes (sliding-window layers kept native never flush)."""
    if isinstance(cache, QuantCache):  # one block of G tokens leaves the residual once it exceeds recent + G - 1
        layer = next(layer for layer in cache.layers if isinstance(layer, BlockLayer))
        G, recent = layer.cfg.k_group_size, layer.cfg.recent_tokens
        return G, max(recent + G - 1 - layer.store.length("residual"), 0)
    layer = cache.layers[0]
    residual = layer.keys.shape[-2] if layer.keys is not None and layer.keys.dim() == 4 else 0
    return layer.residual_length, max(layer.residual_length - 1 - residual, 0)  # HF: all re-quantized at P


def measure_flush(config, dtype: torch.dtype, rows: list[Row], context: int, steps: int = 5) -> list[dict]:
    """Cache-level cost of the periodic flush, which a median decode step misses: `update` of every layer for one
    token, normally and when it flushes (HF's quantized caches re-quantize everything every 128 tokens; QuantCache
    quantizes one 64-token block every 64 tokens). Random states of the model's geometry, no model."""
    c = config.get_text_config(decoder=True)
    H, D = c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    gen = torch.Generator().manual_seed(0)

    def states(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(1, H, n, D, generator=gen).to(dtype), torch.randn(1, H, n, D, generator=gen).to(dtype))

    def update_all(cache, n: int, pos: int) -> float:
        kv = [states(n) for _ in range(c.num_hidden_layers)]
        positions = {"position_ids": torch.arange(pos, pos + n).unsqueeze(0)}  # [1, n]
        t0 = time.perf_counter()
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i, kwargs=positions)
        return time.perf_counter() - t0

    results = []
    for row in dict.fromkeys(Row(r.kind, r.bits) for r in rows if r.kind not in ("default",)):
        cache = row.make_cache(config)
        pos = context
        update_all(cache, context, 0)
        normal = []
        for _ in range(steps):
            normal.append(update_all(cache, 1, pos))
            pos += 1
        period, fill = _flush_state(cache)
        if fill:
            update_all(cache, fill, pos)
            pos += fill
        flush = update_all(cache, 1, pos)
        med = statistics.median(normal)
        results.append({"row": row.label, "context": context, "update_ms": 1e3 * med, "flush_update_ms": 1e3 * flush,
                        "period": period, "amortized_extra_ms_per_token": 1e3 * (flush - med) / period})
        log.info("flush %-16s update %.0f ms, flushing update %.0f ms every %d tokens", row.label, 1e3 * med,
                 1e3 * flush, period)
        del cache
        gc.collect()
    return results


def measure_dtypes(name: str, context: int, steps: int) -> dict:
    """DynamicCache + sdpa in bf16 and fp32: prefill of `context` tokens and median decode step (interleaved)."""
    from transformers import DynamicCache

    out = {}
    models = {}
    for d in DTYPES:
        models[d], tokenizer = load_model(name, dtype=DTYPES[d])
    ids = token_sequences(tokenizer, "eval", 1, context)
    caches, tokens, times = {}, {}, {d: [] for d in DTYPES}
    for d, model in models.items():
        caches[d] = DynamicCache(config=model.config)
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = model(ids, cache=caches[d], use_cache=True, logits_to_keep=1).logits
            out[d] = {"prefill_s": time.perf_counter() - t0}
        tokens[d] = logits[:, -1:].argmax(-1)
    for _ in range(steps):
        for d, model in models.items():
            dt, tokens[d] = decode_step(model, caches[d], tokens[d])
            times[d].append(dt)
    for d in DTYPES:
        out[d]["decode_ms_median"] = 1e3 * statistics.median(times[d])
    return {"context": context, "steps": steps, **out}


# ---------------------------------------------------------------------------------------------------------------
# peak RSS: one child process per row
# ---------------------------------------------------------------------------------------------------------------

def rss_child(args) -> dict:
    """Runs in a child process: generate `rss_new_tokens` tokens after `rss_context` tokens with one row's cache."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamps(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    row = Row.parse(args.rss_child)
    model, tok = load_model(args.model, dtype=DTYPES[args.dtype])
    row.apply_attention(model)
    ids = token_sequences(tok, "eval", 1, args.rss_context)
    cache = row.make_cache(model.config)
    gc.collect()
    rss_before = _rss_kib("VmRSS")
    hwm_reset = True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS
    except OSError:
        hwm_reset = False
    stamps = Stamps()
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=args.rss_new_tokens,
                       min_new_tokens=args.rss_new_tokens, do_sample=False,
                       logits_processor=LogitsProcessorList([stamps]))
    peak = _rss_kib("VmHWM")
    steps = [b - a for a, b in zip(stamps.t, stamps.t[1:])]
    return {
        "row": row.label, "context": args.rss_context, "new_tokens": args.rss_new_tokens,
        "rss_before_generate_mib": rss_before / 1024, "peak_rss_mib": peak / 1024,
        "peak_growth_mib": (peak - rss_before) / 1024, "hwm_reset": hwm_reset,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "kv_bytes_held": cache_bytes(cache), "prefill_s": stamps.t[0] - t0,
        "decode_ms_median": 1e3 * statistics.median(steps) if steps else None,
    }


def measure_rss(args, rows: list[Row]) -> list[dict]:
    results = []
    for row in tqdm(rows, desc="peak RSS (child processes)"):
        cmd = [sys.executable, __file__, "--rss-child", row.spec, "--model", args.model, "--dtype", args.dtype,
               "--threads", str(args.threads), "--rss-context", str(args.rss_context),
               "--rss-new-tokens", str(args.rss_new_tokens)]
        env = dict(os.environ)
        if args.rss_malloc == "mmap":  # allocations >= 128 KiB mmapped, returned on free: RSS tracks live tensors
            env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if proc.returncode != 0:
            log.warning("%s: child failed: %s", row.label, proc.stderr[-2000:])
            results.append({"row": row.label, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "?"})
            continue
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        log.info("rss %-22s peak growth %.0f MiB, KV %.0f MiB", row.label, results[-1]["peak_growth_mib"],
                 results[-1]["kv_bytes_held"] / 2**20)
    base = next((r for r in results if r["row"] == BASE and "error" not in r), None)
    for r in results:
        if "error" in r or base is None:
            continue
        saved = (base["kv_bytes_held"] - r["kv_bytes_held"]) / 2**20
        r["kv_saved_mib"] = saved
        r["rss_reduction_mib"] = base["peak_growth_mib"] - r["peak_growth_mib"]
        r["reduction_over_saved"] = _ratio(r["rss_reduction_mib"], saved) if saved > 0 else None
        r["prefill_speed_vs_default"] = _ratio(base["prefill_s"], r["prefill_s"])
        r["decode_speed_vs_default"] = _ratio(base["decode_ms_median"], r["decode_ms_median"])
    return results


# ---------------------------------------------------------------------------------------------------------------
# targets and report
# ---------------------------------------------------------------------------------------------------------------

def check_targets(result: dict) -> list[dict]:
    """The targets this benchmark reports against, each with the measured value: the literal QuantCache(bits=4) with
    stock sdpa >= 1.0x DynamicCache at 8k and >= 1.1x at 32k; each cache on its faster attention (DynamicCache on
    sdpa or qcache_fp32, QuantCache likewise) >= 1.2x at 8k; quanto 4-bit as shipped <= 0.4x of QuantCache 4-bit;
    prefill >= 0.95x."""
    dec = {(r["row"], r["context"]): r for r in result.get("decode", [])}
    model = result["args"].get("model", "")
    targets = []

    def add(target: str, value: float | None, threshold: float, at_most: bool = False) -> None:
        if value is not None:
            targets.append({"target": target, "value": value,
                            "pass": value <= threshold if at_most else value >= threshold})

    for L, need in ((8192, 1.0), (32768, 1.1)):
        q4 = dec.get(("quant-4bit", L))
        if q4 is not None:
            add(f"the literal QuantCache(bits=4), stock sdpa: decode >= {need}x DynamicCache at {L}",
                q4["speed_vs_default"], need)
    for L in (8192, 32768):
        best = lambda rows: max((dec[(r, L)]["tokens_per_s"] for r in rows if (r, L) in dec), default=None)  # noqa
        q4, ref = best(("quant-4bit", "quant-4bit@fp32")), best(("default", "default@fp32"))
        if q4 is not None and ref is not None:
            add(f"QuantCache(bits=4) vs DynamicCache, each on its faster attention: decode >= 1.2x at {L}",
                q4 / ref, 1.2)
    quanto, q4 = dec.get(("hf-quanto-4bit", 8192)), dec.get(("quant-4bit", 8192))
    if quanto is not None and q4 is not None:
        add("quanto 4-bit as shipped <= 0.4x of QuantCache(bits=4) (both stock sdpa) at 8192",
            quanto["tokens_per_s"] / q4["tokens_per_s"], 0.4, at_most=True)
    prefill = {(r["row"], r["context"]): r for r in result.get("prefill", [])}
    for (row, L), r in sorted(prefill.items()):
        if row == "quant-4bit@fp32" and ("default@fp32", L) in prefill:
            add(f"QuantCache(bits=4) prefill vs DynamicCache, both on qcache_fp32, >= 0.95x at {L}",
                prefill[("default@fp32", L)]["seconds_median"] / r["seconds_median"], 0.95)
        if row == "quant-4bit":
            add(f"QuantCache(bits=4) prefill, stock sdpa, >= 0.95x DynamicCache at {L}", r["speed_vs_default"], 0.95)
    for r in result.get("rss", []):
        if r["row"].startswith("quant-") and r.get("reduction_over_saved") is not None:
            add(f"{r['row']}: peak RSS reduction >= 70% of KV bytes saved at {r['context']}",
                r["reduction_over_saved"], 0.7)
    for t in targets:
        t["model"] = model
    return targets


def _f(x, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def to_markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Speed benchmark: {a['model']} ({a['dtype']}, batch 1, greedy)", "",
             f"Command: `{result['command']}`  ",
             f"Date: {result['date']}; machine: {result['machine']}; load average {result['load_before']} before, "
             f"{result['load_after']} after; {result['wall_minutes']:.1f} min  ",
             f"qcache {result['qcache_version']} (git {result.get('git', '?')}), torch {result['torch']}, "
             f"transformers {result['transformers']}", "",
             "Every speed is a ratio to DynamicCache with stock sdpa measured in the same run (x > 1: faster). Rows "
             "`@fp32` use qcache's fp32-accumulating attention (`qcache_fp32`), the others stock `sdpa`. Stock sdpa "
             "decodes without a mask through SDPA's `enable_gqa=True`, which the CPU flash kernel runs ~8x slower "
             "for one query than qcache_fp32's folding of the query heads sharing a kv head (no K/V copy): that, not "
             "fp32, is why `@fp32` rows decode faster. Quant rows without `+kernel` run the default kernel='auto' "
             "(the compiled read; decode steps through qcache's C kernel, qcache/native.py, where it builds): their "
             "decode steps attend from the codes under stock sdpa and under qcache_fp32 alike (qcache/handover.py): "
             "scores and the weighted sum of values computed from the codes in fp32, no dequantized K/V handed to "
             "attention. `+compiled` rows decode with the torch.compile'd `kernels.decode_attention` instead; "
             "`+eager` rows read with plain PyTorch ops and hand attention the dequantized cache.", ""]
    if result.get("targets"):
        lines += ["## Targets", "", "Speeds are ratios of tokens/s (or of 1 / prefill seconds); the quanto line compares "
                  "QuantCache 4-bit with hf-quanto 4-bit in the same run; the RSS target is (default's peak RSS growth "
                  "- the row's) / (default's KV bytes - the row's).", "",
                  "| target | measured | |", "|---|---:|---|"]
        lines += [f"| {t['target']} | {t['value']:.2f} | {'PASS' if t['pass'] else '**FAIL**'} |"
                  for t in result["targets"]]
        lines.append("")
    if result.get("decode"):
        ctxs = sorted({r["context"] for r in result["decode"]})
        lines += [f"## Decode ({a['rounds']} rounds x {a['steps']} steps per row and context, interleaved; "
                  "median step)",
                  "", "| cache | " + " | ".join(f"{L} tok/s | {L} vs default | {L} ms mean" for L in ctxs) + " |",
                  "|---|" + "---:|---:|---:|" * len(ctxs)]
        by = {(r["row"], r["context"]): r for r in result["decode"]}
        for label in dict.fromkeys(r["row"] for r in result["decode"]):
            cells = []
            for L in ctxs:
                r = by[(label, L)]
                cells.append(f"{r['tokens_per_s']:.2f} | **{r['speed_vs_default']:.2f}x** | {r['step_ms_mean']:.0f}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        cost = []
        for plain, fp32 in (("default", "default@fp32"), ("quant-4bit", "quant-4bit@fp32")):
            for L in ctxs:
                if (plain, L) in by and (fp32, L) in by:
                    stock, ours = by[(plain, L)]["step_ms_median"], by[(fp32, L)]["step_ms_median"]
                    cost.append(f"| {plain} | {L} | {stock:.0f} | {ours:.0f} | **{stock / ours:.2f}x** |")
        same = []
        for label in dict.fromkeys(r["row"] for r in result["decode"]):
            if label.endswith("@fp32") and label != "default@fp32":
                cells = [f"**{by[('default@fp32', L)]['step_ms_median'] / by[(label, L)]['step_ms_median']:.2f}x**"
                         if ("default@fp32", L) in by and (label, L) in by else "n/a" for L in ctxs]
                same.append(f"| {label} | " + " | ".join(cells) + " |")
        if same:
            lines += ["", "### Decode speed vs DynamicCache with the same attention (qcache_fp32 on both)", "",
                      "| cache | " + " | ".join(f"{L}" for L in ctxs) + " |", "|---|" + "---:|" * len(ctxs), *same]
        if cost:
            lines += ["", "### Cost of fp32-accumulating attention (decode step, same cache)", "",
                      "| cache | context | stock sdpa ms | qcache_fp32 ms | speed of qcache_fp32 vs sdpa |",
                      "|---|---:|---:|---:|---:|", *cost]
        lines += ["", "## Bytes held per token (counted from the cache's tensors after the fill)", "",
                  "| cache | " + " | ".join(f"{L}" for L in ctxs) + " |", "|---|" + "---:|" * len(ctxs)]
        for label in dict.fromkeys(r["row"] for r in result["decode"]):
            lines.append(f"| {label} | " + " | ".join(f"{by[(label, L)]['bytes_per_token']:.0f}" for L in ctxs) + " |")
        lines.append("")
    if result.get("prefill"):
        lines += [f"## Prefill (fresh cache, one forward, median of {a['prefill_repeats']}, interleaved)", "",
                  "| cache | context | seconds | vs default |", "|---|---:|---:|---:|"]
        lines += [f"| {r['row']} | {r['context']} | {r['seconds_median']:.2f} | **{r['speed_vs_default']:.2f}x** |"
                  for r in result["prefill"]]
        lines.append("")
    if result.get("rss"):
        lines += [f"## Peak RSS of a {a['rss_context']}-token generation ({a['rss_new_tokens']} new tokens; one child "
                  f"process per cache, run one after another; malloc: {a['rss_malloc']})", "",
                  "| cache | KV held (MiB) | KV saved (MiB) | peak RSS growth (MiB) | RSS reduction (MiB) | "
                  "reduction / saved | peak RSS (MiB) | prefill s | prefill vs default | decode ms | "
                  "decode vs default |", "|---|" + "---:|" * 10]
        if a["rss_malloc"] == "mmap":
            lines[-2:-2] = ["The children's timings are not speed results: with MALLOC_MMAP_THRESHOLD_ every "
                            "temporary >= 128 KiB is a fresh mmap that page-faults, which slows allocation-heavy code "
                            "(QuantCache's decode, HQQ's quantizer) far more than the default allocator does. Use the "
                            "interleaved tables above for speed.", ""]
        for r in result["rss"]:
            if "error" in r:
                lines.append(f"| {r['row']} | error: {r['error']} |" + " |" * 9)
                continue
            lines.append(
                f"| {r['row']} | {r['kv_bytes_held'] / 2**20:.1f} | {_f(r.get('kv_saved_mib'), '.1f')} | "
                f"{r['peak_growth_mib']:.0f} | {_f(r.get('rss_reduction_mib'), '.0f')} | "
                f"{_f(r.get('reduction_over_saved'), '.2f')} | {r['peak_rss_mib']:.0f} | {r['prefill_s']:.1f} | "
                f"{_f(r.get('prefill_speed_vs_default'), '.2f')} | {_f(r['decode_ms_median'], '.0f')} | "
                f"{_f(r.get('decode_speed_vs_default'), '.2f')} |")
        lines.append("")
    if result.get("flush"):
        lines += [f"## Periodic flush (cache.update of all layers for one token at {result['flush'][0]['context']} "
                  "tokens; random states, no model)", "",
                  "A median decode step misses the flush: HF's quantized caches re-quantize their whole cache every "
                  "`residual_length` tokens, QuantCache quantizes one block every `k_group_size` tokens.", "",
                  "| cache | update ms | flushing update ms | every (tokens) | amortized extra ms/token |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['row']} | {r['update_ms']:.0f} | {r['flush_update_ms']:.0f} | {r['period']} | "
                  f"{r['amortized_extra_ms_per_token']:.1f} |" for r in result["flush"]]
        lines.append("")
    if result.get("profiles"):
        for p in result["profiles"]:
            lines += [f"## Profile: {p['row']} decode at {p['context']} tokens ({p['steps']} steps; "
                      f"{p['wall_ms_per_step']:.0f} ms/step wall, {p['profiled_ms_per_step']:.0f} ms/step in ops)", ""]
            if p["attention_ms_per_step"]:  # the fused row attends in BlockLayer.decode_attention instead
                lines += [f"Attention (`aten::scaled_dot_product_attention`, inclusive): "
                          f"{p['attention_ms_per_step']:.0f} ms/step", ""]
            if p["regions"]:
                lines += ["| qcache region (inclusive) | ms/step | calls/step |", "|---|---:|---:|"]
                lines += [f"| {r['region']} | {r['ms_per_step']:.1f} | {r['calls_per_step']:.0f} |"
                          for r in p["regions"]]
                lines.append("")
            lines += ["| top op (self time) | ms/step | calls/step | % |", "|---|---:|---:|---:|"]
            lines += [f"| {o['op']} | {o['self_ms_per_step']:.1f} | {o['calls_per_step']:.0f} | {o['pct']:.1f} |"
                      for o in p["top_ops"]]
            lines.append("")
    if result.get("accumulation"):
        acc = result["accumulation"]
        lines += [f"## Accumulation: flat attention in bf16 (one query, n = {acc['n']} keys, equal scores, "
                  "V in [1, 2))",
                  "", f"Output vs mean(V), max relative error (rounding the output to bf16 alone: up to "
                  f"{acc['bf16_unit_roundoff']:.1e}); last row: the sum of the n weights 1/n accumulated in bf16.",
                  "", "| implementation | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.2e} |" for k, v in acc["max_rel_error"].items()]
        lines.append("")
    if result.get("dtypes"):
        d = result["dtypes"]
        lines += [f"## Model dtype check (DynamicCache + sdpa, {d['context']} tokens)", "",
                  "| dtype | prefill s | decode ms (median) |", "|---|---:|---:|"]
        lines += [f"| {k} | {d[k]['prefill_s']:.2f} | {d[k]['decode_ms_median']:.0f} |" for k in DTYPES]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="short name, HF directory or hub id")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="model dtype")
    p.add_argument("--out", default="docs/results/speed", help="output path without extension (.json and .md)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    p.add_argument("--rows", nargs="*", default=DEFAULT_ROWS,
                   help="caches as KIND[:BITS][:NAME=VALUE,...][@fp32] (kinds: default, quant, hf-quanto, hf-hqq, "
                        "hf-fp8; @fp32: qcache's fp32 attention); "
                        "'default' (DynamicCache, stock sdpa) is always included")
    p.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096, 8192], help="decode context lengths")
    p.add_argument("--rounds", type=int, default=3, help="decode rounds per context (rows interleaved)")
    p.add_argument("--steps", type=int, default=3, help="decode steps per row per round")
    p.add_argument("--fill-chunk", type=int, default=1024, help="tokens per forward when filling the reference cache")
    p.add_argument("--prefill-contexts", type=int, nargs="*", default=[1024], help="prefill lengths (fresh cache)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="prefill repeats (median)")
    p.add_argument("--rss-rows", nargs="*", default=DEFAULT_RSS_ROWS, help="rows measured for peak RSS ('' for none)")
    p.add_argument("--rss-context", type=int, default=8192, help="prompt tokens of the RSS generation")
    p.add_argument("--rss-new-tokens", type=int, default=4, help="tokens generated in the RSS generation")
    p.add_argument("--rss-malloc", choices=["mmap", "glibc"], default="mmap",
                   help="mmap: children run with MALLOC_MMAP_THRESHOLD_=131072, so freed tensors leave RSS at once and "
                        "the peak measures live memory; glibc: the default dynamic threshold (peaks then include heap "
                        "fragmentation and varied by up to 80 MiB between identical 4k runs)")
    p.add_argument("--malloc", choices=["glibc", "tuned"], default="glibc",
                   help="the timed process's allocator settings: glibc's defaults (what a process gets unless told "
                        "otherwise: large freed tensors may be unmapped and page-faulted in again), or tuned (mmap and trim thresholds raised "
                        "to 1 GiB with mallopt, as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ would): freed tensors "
                        "are reused without page faults, as with jemalloc or tcmalloc")
    p.add_argument("--profile", nargs="*", default=["quant:4", "quant:4@fp32", "default@fp32", "default"],
                   help="rows profiled at the largest decode context")
    p.add_argument("--profile-steps", type=int, default=3, help="decode steps profiled per row")
    p.add_argument("--profile-top", type=int, default=14, help="top ops listed per profile")
    p.add_argument("--flush-context", type=int, default=8192,
                   help="context of the cache-level flush-cost measurement (0: skip)")
    p.add_argument("--accumulation-n", type=int, default=131072, help="keys of the flat-attention check (0: skip)")
    p.add_argument("--dtype-check", action=argparse.BooleanOptionalAction, default=True,
                   help="time DynamicCache prefill/decode in bf16 and fp32 at --dtype-check-context")
    p.add_argument("--dtype-check-context", type=int, default=1024, help="context of the dtype check")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only rewrite the targets and the .md of a saved result JSON (no measurement)")
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)  # internal: run one RSS measurement
    return p


def _tune_malloc() -> None:
    """glibc: raise the mmap and trim thresholds to 1 GiB (`--malloc tuned`), so large freed tensors stay in the heap
    and are reused instead of being unmapped and page-faulted in again at the next allocation."""
    libc = ctypes.CDLL("libc.so.6")
    for param in (-3, -1):  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
        if libc.mallopt(param, 1 << 30) != 1:
            raise RuntimeError(f"mallopt({param}, 1 GiB) failed: --malloc tuned needs glibc; allowed: --malloc glibc")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if args.rss_child is not None:
        print(json.dumps(rss_child(args)))
        return 0
    if args.render is not None:
        path = Path(args.render)
        result = json.loads(path.read_text())
        result["targets"] = check_targets(result)
        path.write_text(json.dumps(result, indent=2) + "\n")
        path.with_suffix(".md").write_text(to_markdown(result) + "\n")
        print(to_markdown(result))
        return 0
    import transformers

    if args.malloc == "tuned":
        _tune_malloc()
    start = time.perf_counter()
    rows = [Row.parse(s) for s in dict.fromkeys([BASE, *args.rows])]
    labels = {r.label for r in rows}
    result = {
        "command": " ".join(["python", "bench/bench_speed.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{describe_machine()}, CPU (shared), malloc {args.malloc}",
        "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg()),
        "qcache_version": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "git": _git_state(), "args": vars(args),
    }
    if args.accumulation_n:
        result["accumulation"] = measure_accumulation(args.accumulation_n)
    model, tok = load_model(args.model, dtype=DTYPES[args.dtype])
    need = max([*args.contexts, *args.prefill_contexts, 1]) + 1
    ids = token_sequences(tok, "eval", 1, need)
    result["prefill"] = measure_prefill(model, ids, rows, args.prefill_contexts, args.prefill_repeats)
    profile_rows = [r for r in map(Row.parse, args.profile) if r.label in labels]
    result["decode"], result["profiles"] = measure_decode(
        model, ids, rows, args.contexts, args.rounds, args.steps, args.fill_chunk, profile_rows, args.profile_steps,
        args.profile_top) if args.contexts else ([], [])
    config = model.config
    del model
    gc.collect()
    if args.flush_context:
        result["flush"] = measure_flush(config, DTYPES[args.dtype], rows, args.flush_context)
    rss_specs = [s for s in args.rss_rows if s]
    rss_rows = [Row.parse(s) for s in dict.fromkeys([BASE, *rss_specs])] if rss_specs else []
    result["rss"] = measure_rss(args, rss_rows) if rss_rows else []
    if args.dtype_check:
        result["dtypes"] = measure_dtypes(args.model, args.dtype_check_context, 2 * args.steps)
    result["targets"] = check_targets(result)
    result["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    result["wall_minutes"] = (time.perf_counter() - start) / 60
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=2) + "\n")
    Path(f"{out}.md").write_text(to_markdown(result) + "\n")
    print(to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
