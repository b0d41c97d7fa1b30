"""GPU check: QuantCache's decode speed and memory against DynamicCache on the shapes of real models, and its read
paths against the eager read, in at most 8 minutes on one GPU.

    bash bench/gpu_run.sh                        # on the lent GPU machine: installs .gpu-wheels/ offline, then runs
    python bench/gpu_check.py --out "$OUT/gpu-check"   # CUDA -> <out>.json, <out>.md (default docs/results/gpu-check)
    python bench/gpu_check.py --cpu-smoke --out /tmp/smoke   # the same code on CPU, tiny models, well under a minute

Models are built in memory, on the device, in bf16, from configs of real geometry with random weights: speed and
memory follow the shapes, not the weight values, so nothing is downloaded or read besides this repository.

    qwen2.5-1.5b   Qwen2, the shape of Qwen2.5-Coder-1.5B: 28 layers, hidden 1536, MLP 8960, 12 query / 2 KV heads of
                   128, vocab 151936, tied embeddings, rope_theta 1e6
    llama3.1-8b    Llama, the shape of Llama-3.1-8B: 32 layers, hidden 4096, MLP 14336, 32 / 8 heads of 128, vocab
                   128256, rope_theta 500000 with llama3 scaling (factor 8, low 1, high 4, original 8192)

`--cpu-smoke` builds tiny configs of the same families (tiny-qwen2, tiny-llama3: 2 layers, hidden 64) and runs every
section at contexts of a few hundred tokens; what needs CUDA (the compiled read paths, torch.cuda memory counters,
the copy bandwidth, CUDA-event timing, flash attention) is skipped with the reason. tests/test_gpu_check.py runs it.

Sections (each its own budget, in a child process that the parent kills when a section overruns or the total budget
is spent; a section that raises or is killed is recorded with its error and the rows it had emitted, and the next
one runs; <out>.json and <out>.md are rewritten whenever a row or a section comes in, so a killed run leaves what it
measured):

    env        versions, the device, the bandwidth of a device-to-device copy (bytes read + written per second),
               whether torch.compile (inductor -> Triton) builds and runs here (qcache.kernels.resolve_kernel)
    paths      qwen2.5-1.5b, QuantCache at 8 and at 4 bits, a real prefill of random token ids: each read path
               ("eager": kernel="eager" with sdpa; "compiled": kernel="compiled" with sdpa, whose decode steps attend
               from the codes through the handover; "eager@fp32" / "compiled@fp32": the same with qcache_fp32
               attention) on the same stored codes (reads, one step's logits) and end to end (greedy tokens,
               logits) against the eager path of the same attention
    decode     per model, context (8192, 32768) and batch (1, 8): decode tokens/s (median of CUDA-synchronized steps
               after warm-up) of DynamicCache with sdpa (and flash_attention_2 where flash-attn is importable),
               QuantCache(bits=4) as a user writes it (`past_key_values=QuantCache(bits=4)`, stock sdpa) and
               Transformers' quanto 4-bit cache (where optimum-quanto is importable and its extension for the
               device is built: it compiles at first use, minutes, so never inside a section), each as a ratio to
               DynamicCache;
               memory: torch.cuda.memory_allocated growth over the fill, max_memory_allocated over the fill and over
               the decode, next to the formula (qcache.tools.size, i.e. qcache.layout.bytes_per_token) and
               cache.memory(); the step's bytes (weights + cache) per step time, and for QuantCache the bytes it
               holds per time of its fused decode attention (CUDA events), against the copy bandwidth. A row whose
               memory estimate does not fit the device is skipped with the estimate.

Caches are filled by replaying random keys and values through `update()` in chunks, layer by layer (as a chunked
prefill calls it), with each layer's attention module on the stack (QuantCache(bits=4) binds to the model from
there); only the decode steps are measured.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import math
import os
import platform
import signal
import statistics
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

TOTAL_BUDGET_S = 450  # the whole CUDA run; with the wheel install it stays under the device tool's 8 minutes
SMOKE_BUDGET_S = 120
BASE_ROW = "default"
# decode rows: label -> (cache kind, attention); every ratio is taken against BASE_ROW
DECODE_ROWS = {"default": ("dynamic", "sdpa"), "default@flash_attention_2": ("dynamic", "flash_attention_2"),
               "quant-4bit": ("quant4", "sdpa"), "hf-quanto-4bit": ("quanto4", "sdpa")}
# path -> (QuantCacheConfig.kernel, attention); each is compared with the eager path of the same attention
PATHS = {"eager": ("eager", "sdpa"), "eager@fp32": ("eager", "fp32"), "compiled": ("compiled", "sdpa"),
         "compiled@fp32": ("compiled", "fp32")}
CUDA_ONLY_PATHS = ("compiled", "compiled@fp32")  # inductor -> Triton is the point; on CPU see tests/test_kernels.py
PATH_REFERENCE = {"eager": None, "eager@fp32": "eager", "compiled": "eager", "compiled@fp32": "eager@fp32"}
READ_RTOL = 2.0 ** -7  # reads agree within 2 bf16 ulps of the largest magnitude (the compiled read fuses the casts)
LOGITS_RTOL = 0.05  # a step's logits agree when max |diff| <= this x max |reference logits|
HEADROOM = 2 * 2**30  # bytes kept free on the GPU beyond a row's estimate (CUDA context, allocator fragmentation)


@dataclass(frozen=True)
class Section:
    """One guarded unit of the check.

    Args:
        kind: "env", "paths" or "decode".
        budget_s: seconds it may run before the parent kills it.
        model: the model (paths, decode).
        bits: QuantCache's width (paths).
        context: tokens in the cache before decoding (decode).
        batch: sequences decoded together (decode).
    """

    kind: str
    budget_s: float
    model: str | None = None
    bits: int | None = None
    context: int | None = None
    batch: int | None = None

    @property
    def name(self) -> str:
        """"env", "paths/<model>/<bits>bit" or "decode/<model>/<context>/b<batch>"."""
        if self.kind == "paths":
            return f"paths/{self.model}/{self.bits}bit"
        if self.kind == "decode":
            return f"decode/{self.model}/{self.context}/b{self.batch}"
        return self.kind


def plan(smoke: bool) -> list[Section]:
    """The sections of a run, cheapest first within each kind: real shapes at 8k/32k on CUDA, tiny models at a few
    hundred tokens in smoke mode.

    Example:
        >>> [s.name for s in plan(smoke=True)][:4]
        ['env', 'paths/tiny-qwen2/8bit', 'paths/tiny-qwen2/4bit', 'decode/tiny-qwen2/384/b1']
    """
    if smoke:
        # contexts past sinks + recent window + one block (4 + 128 + 128), so that some tokens are quantized
        models, contexts, budget = ("tiny-qwen2", "tiny-llama3"), (384, 640), 30
        out = [Section("env", budget)] + [Section("paths", budget, models[0], bits) for bits in (8, 4)]
        return out + [Section("decode", budget, m, context=L, batch=b)
                      for m in models for L in contexts for b in (1, 8)]
    # budgets are caps: the first QuantCache of a model compiles its Triton kernels (tens of seconds; each batch size
    # 1 vs > 1 and each KV-head count is its own compile); the total (TOTAL_BUDGET_S) holds the run to 8 minutes, a
    # section starting late gets what is left
    out = [Section("env", 40), Section("paths", 100, "qwen2.5-1.5b", 8), Section("paths", 80, "qwen2.5-1.5b", 4)]
    for model in ("qwen2.5-1.5b", "llama3.1-8b"):
        for L in (8192, 32768):
            for b in (1, 8):
                first = L == 8192
                out.append(Section("decode", (90 if model.startswith("llama") else 60) if first else 45, model,
                                   context=L, batch=b))
    return out


# ---------------------------------------------------------------------------------------------------------------
# models: configs of real geometry, random weights
# ---------------------------------------------------------------------------------------------------------------

QWEN2 = dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
             num_attention_heads=12, num_key_value_heads=2, head_dim=128, max_position_embeddings=32768,
             tie_word_embeddings=True, rms_norm_eps=1e-6, use_sliding_window=False,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
LLAMA31 = dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
               tie_word_embeddings=False, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
MODELS = {
    "qwen2.5-1.5b": QWEN2,
    "llama3.1-8b": LLAMA31,
    "tiny-qwen2": QWEN2 | _TINY,
    "tiny-llama3": LLAMA31 | _TINY | {"rope_parameters": LLAMA31["rope_parameters"] | {
        "original_max_position_embeddings": 128}},  # the llama3 scaling bends within the smoke contexts
}
_LOADED: dict = {}


def model_config(name: str):
    """The transformers config of model `name` (a key of MODELS)."""
    from transformers import LlamaConfig, Qwen2Config

    if name not in MODELS:
        raise ValueError(f"model {name!r} is not known; allowed: {list(MODELS)}")
    spec = dict(MODELS[name])
    family = spec.pop("family")
    return (Qwen2Config if family == "qwen2" else LlamaConfig)(**spec)


def load(name: str, device: torch.device, dtype: torch.dtype):
    """Model `name` with random weights (seeded), built on `device` in `dtype`, once per process; building another
    model frees the previous one first (the 8B shape leaves no room for two)."""
    key = (name, str(device), dtype)
    if key not in _LOADED:
        from transformers import AutoModelForCausalLM

        _LOADED.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch.manual_seed(0)
        with torch.device(device):  # parameters are created (and initialised) on the device: seconds, not minutes
            model = AutoModelForCausalLM.from_config(model_config(name), dtype=dtype, attn_implementation="sdpa")
        _LOADED[key] = model.eval()
    return _LOADED[key]


def weight_bytes_read(model) -> int:
    """Bytes of weights a decode step reads: every parameter, less the input embedding where it is not the LM head
    too (a step reads one row of it)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total - (0 if embed is head else embed.numel() * embed.element_size())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _set_attention(model, attn: str) -> None:
    from qcache import use_fp32_attention

    if attn == "fp32":
        use_fp32_attention(model)
    else:
        model.set_attn_implementation(attn)


def random_ids(model, batch: int, length: int, seed: int) -> torch.Tensor:
    """[batch, length] seeded random token ids (on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=gen)


@torch.no_grad()
def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed `ids` [B, L] through `cache` `chunk` tokens at a time; the greedy next token [B, 1]."""
    device = next(model.parameters()).device
    out = None
    for start in range(0, ids.shape[1], chunk):
        out = model(ids[:, start:start + chunk].to(device), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


@torch.no_grad()
def greedy(model, cache, token: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """`steps` greedy decode steps from `token` [1, 1]: (tokens, logits [steps, V] fp32 on the CPU)."""
    tokens, logits = [], []
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True).logits[:, -1]  # [1, V]
        logits.append(out.float().cpu())
        token = out.argmax(-1, keepdim=True)
        tokens.append(int(token))
    return tokens, torch.cat(logits)


@torch.no_grad()
def fill(model, cache, batch: int, length: int, chunk: int) -> None:
    """Random keys and values [batch, kv_heads, n, head_dim] through `cache.update`, `chunk` tokens at a time and
    layer by layer within a chunk, as a chunked prefill calls it, with the chunk's position_ids. Each call has its
    layer's attention module as a local of this frame, where a cache built without a config (QuantCache(bits=4),
    qcache/binding.py) finds its model, as in a forward."""
    text = model.config.get_text_config(decoder=True)
    heads, dim = text.num_key_value_heads, text.head_dim
    param = next(model.parameters())
    modules = sorted((m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "config")),
                     key=lambda m: m.layer_idx)
    gen = torch.Generator(param.device).manual_seed(length)
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        pos = torch.arange(start, start + n, device=param.device).expand(batch, n)
        for attention in modules:
            shape = (batch, heads, n, dim)
            k = torch.randn(shape, generator=gen, device=param.device, dtype=param.dtype)
            v = torch.randn(shape, generator=gen, device=param.device, dtype=param.dtype)
            cache.update(k, v, attention.layer_idx, kwargs={"position_ids": pos})
            del k, v


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
    memory_limit: float | None  # bytes the device may hold (None: the GPU's own, no limit on the CPU)
    emit: Callable[[dict], None]  # record one row (kept if the section is killed later)


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, reps: int = 10) -> dict:
    """A device-to-device copy of `nbytes` (random bytes), timed with CUDA events after 3 warm-ups: the median's
    bytes read + written per second."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    median = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "median_s": median, "bytes_per_s": 2 * nbytes / median,
            "spread": (max(times) - min(times)) / median}


def section_env(sec: Section, ctx: Context) -> dict:
    import importlib.util

    import transformers

    import qcache
    from qcache.kernels import resolve_kernel

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "qcache": qcache.__version__,
            "python": platform.python_version(), "device": str(ctx.device), "dtype": str(ctx.dtype),
            "cuda_available": torch.cuda.is_available(), "cpu_count": os.cpu_count(),
            "flash_attn": _flash_attention_missing() or "importable",
            "optimum_quanto": _quanto_missing(ctx.device) or "ready",
            "kernels": "importable" if importlib.util.find_spec("kernels") else "not installed"}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as err:
        info["triton"] = f"not importable: {err}"
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update({"gpu": props.name, "gpu_memory_gib": props.total_memory / 2**30,
                     "multiprocessors": props.multi_processor_count,
                     "capability": f"{props.major}.{props.minor}", "cuda": torch.version.cuda})
        info["copy_bandwidth"] = copy_bandwidth(ctx.device)
    else:
        info["copy_bandwidth"] = {"skipped": "CUDA only (a device-to-device copy timed with CUDA events)"}
    start = time.perf_counter()
    if ctx.smoke:
        info["auto_kernel"] = "not probed in smoke mode (a CPU compile takes tens of seconds)"
    else:
        info["auto_kernel"] = resolve_kernel("auto", ctx.device)  # "compiled" iff torch.compile builds and runs here
        info["auto_kernel_probe_s"] = time.perf_counter() - start
        info["torch_compile_works"] = info["auto_kernel"] == "compiled"
    return info


def _flash_attention_missing() -> str | None:
    """None where transformers can run flash_attention_2, else why not."""
    from transformers.utils import is_flash_attn_2_available

    return None if is_flash_attn_2_available() else "not installed (flash-attn is not importable, or no CUDA)"


def _quanto_missing(device: torch.device | None = None) -> str | None:
    """None where Transformers' quanto cache can run on `device` now, else why not: optimum-quanto is not
    importable, or its C++/CUDA extension for this device type (which it compiles at first use, minutes with nvcc)
    is not built yet. The build is left out of a timed section: a section killed while it builds leaves a lock
    behind that stalls every later use."""
    import importlib.util

    if not (importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto")):
        return "not installed (optimum-quanto is not importable)"
    if device is None:
        return None
    from optimum.quanto.library.extensions import get_extension, is_extension_available

    name = {"cuda": "quanto_cuda", "cpu": "quanto_cpp"}.get(device.type)
    if name is None or not is_extension_available(name):
        return None  # no extension for this device: quanto runs its Python ops
    ext = get_extension(name)
    built = Path(ext.build_directory, "pytorch_version.txt")
    if not built.exists() or built.read_text().strip() != torch.__version__:
        return (f"optimum-quanto's {name} extension is not built for torch {torch.__version__} (it compiles at "
                f"first use, minutes; build it once outside this check: {ext.build_directory})")
    return None


def _block_layers(cache) -> list:
    from qcache.layers import BlockLayer

    return [layer for layer in cache.layers if isinstance(layer, BlockLayer)]


def _count_fused(cache) -> list[int]:
    """Wrap every BlockLayer's decode_attention with a call counter; returns the counter (one slot)."""
    calls = [0]
    for layer in _block_layers(cache):
        inner = layer.decode_attention

        def counted(*args, _inner=inner, **kwargs):
            calls[0] += 1
            return _inner(*args, **kwargs)

        layer.decode_attention = counted
    return calls


def _set_kernel(cache, kernel: str) -> None:
    """Read `cache`'s stored codes with `kernel` from now on (every BlockLayer; the same codes, another read path):
    "eager" reads eagerly and hands attention the read, "compiled" reads with the compiled kernels and attends from
    the codes at decode steps."""
    for layer in _block_layers(cache):
        if not (hasattr(layer, "kernel") and hasattr(layer, "decode_kernel")):
            raise RuntimeError("BlockLayer has no `kernel` / `decode_kernel` attribute: this check no longer knows "
                               "how to switch the read path of a filled cache")
        layer.kernel, layer.decode_kernel = (kernel, None) if kernel == "eager" else (kernel, kernel)


def _reads(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.float().cpu() for t in layer.read()) for layer in _block_layers(cache)]


def _max_rel(a: list, b: list) -> float:
    """Largest |a - b| / max |b| over every layer's keys and values."""
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
               for pa, pb in zip(a, b) for x, y in zip(pa, pb))


@torch.no_grad()
def _step_logits(model, cache, token: torch.Tensor) -> torch.Tensor:
    return model(token, past_key_values=cache, use_cache=True).logits[0, -1].float().cpu()  # [V]


def section_paths(sec: Section, ctx: Context) -> dict:
    """The read paths against eager on the same stored codes (reads, one decode step), and end to end (each path
    fills its own cache by a real prefill and decodes greedily)."""
    from qcache import QuantCache

    model = load(sec.model, ctx.device, ctx.dtype)
    length, steps, chunk = (320, 4, 64) if ctx.smoke else (2048, 16, 512)
    ids = random_ids(model, 1, length, seed=length)
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
        cache = QuantCache(bits=sec.bits, kernel="eager")
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
            diff, scale = float((logits - ref_logits).abs().max()), float(ref_logits.abs().max())
            row = {"path": path, "kernel": kernel, "attention": attn, "read_max_rel_diff": read_err,
                   "reads_agree": read_err <= READ_RTOL, "step_logits_max_abs_diff": diff, "logits_scale": scale,
                   "logits_agree": diff <= LOGITS_RTOL * scale,
                   "step_argmax_equal": int(logits.argmax()) == int(ref_logits.argmax()),
                   "fused_decode_calls": fused[0], "seconds": time.perf_counter() - start}
            same_codes.append(row)
            ctx.emit({"same_codes": row})
        del cache
    end_to_end = {}
    for path in paths:
        kernel, attn = PATHS[path]
        _set_attention(model, attn)
        cache = QuantCache(bits=sec.bits, kernel=kernel)
        start = time.perf_counter()
        token = prefill(model, cache, ids, chunk)
        fused = _count_fused(cache)
        tokens, logits = greedy(model, cache, token, steps)
        _sync(ctx.device)
        end_to_end[path] = {"tokens": tokens, "logits": logits, "fused_decode_calls": fused[0],
                            "seconds": time.perf_counter() - start}
        ctx.emit({"end_to_end": {"path": path, "tokens": tokens, "fused_decode_calls": fused[0]}})
        del cache
    _set_attention(model, "sdpa")
    rows = []
    for path, run in end_to_end.items():
        ref = end_to_end.get(PATH_REFERENCE[path]) if PATH_REFERENCE[path] else None
        row = {"path": path, "reference": PATH_REFERENCE[path], "tokens": run["tokens"],
               "fused_decode_calls": run["fused_decode_calls"], "seconds": run["seconds"]}
        if ref is not None:
            same = next((i for i, (a, b) in enumerate(zip(run["tokens"], ref["tokens"])) if a != b), steps)
            # logits compared while the two runs decode the same tokens (after a difference the inputs differ)
            diff = float((run["logits"][:same + 1] - ref["logits"][:same + 1]).abs().max())
            scale = float(ref["logits"][:same + 1].abs().max())
            row.update({"tokens_equal": run["tokens"] == ref["tokens"], "tokens_agree_for": same,
                        "logits_max_abs_diff": diff, "logits_scale": scale,
                        "logits_agree": diff <= LOGITS_RTOL * scale})
        rows.append(row)
    fused_rows = [r for r in same_codes + rows if PATHS[r["path"]][0] == "compiled"]
    return {"bits": sec.bits, "context": length, "decode_steps": steps, "logits_rtol": LOGITS_RTOL,
            "same_codes": same_codes, "end_to_end": rows, "skipped": skipped,
            "fused_path_ran": all(r["fused_decode_calls"] > 0 for r in fused_rows) if fused_rows else None}


def _formula_bytes(config, kind: str, context: int, batch: int) -> float | None:
    """What qcache.tools.size's formula says `batch` sequences of `context` tokens hold (None: no formula)."""
    from qcache.tools.size import Geometry, cache_bytes

    fmt = {"dynamic": "16-bit", "quant4": "qcache-4bit"}.get(kind)
    if fmt is None:
        return None
    return batch * sum(cache_bytes(Geometry.from_config(config), fmt, context))


def _make_cache(kind: str, config):
    if kind == "dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=config)
    if kind == "quant4":
        from qcache import QuantCache

        return QuantCache(bits=4)  # as a user writes it: no config (it binds to the model), kernel="auto"
    from eval.caches import build_cache

    return build_cache("hf-quanto", config, 4)


def _memory_estimate(model, kind: str, context: int, batch: int, chunk: int) -> dict:
    """Bytes a row needs beyond the weights: its cache (the formula; the 16-bit one bounds quanto's) and the
    transients of the fill and the decode (a layer's keys and values at 16 bits, twice for the concatenation or
    the read, once more for the decode's read; a chunk's random keys/values and the quantizer's fp32 copies;
    the logits)."""
    text = model.config.get_text_config(decoder=True)
    per_layer = batch * context * 2 * text.num_key_value_heads * text.head_dim * 2  # bf16 K + V of one layer
    chunk_bytes = batch * min(chunk, context) * 2 * text.num_key_value_heads * text.head_dim * 4  # fp32
    cache = _formula_bytes(model.config, kind if kind != "quanto4" else "dynamic", context, batch)
    transient = 3 * per_layer + 4 * chunk_bytes + 2 * batch * text.vocab_size * 4
    return {"cache": cache, "transient": transient, "total": cache + transient}


def _available_bytes(model, ctx: Context) -> float | None:
    """Bytes free for a row: the device's memory (or --memory-limit-gib) less what is allocated now (the weights,
    on the CPU) and HEADROOM on CUDA; None: no limit (the CPU without --memory-limit-gib)."""
    if ctx.device.type == "cuda":
        total = ctx.memory_limit or torch.cuda.get_device_properties(ctx.device).total_memory
        return total - torch.cuda.memory_allocated(ctx.device) - HEADROOM
    if ctx.memory_limit is None:
        return None
    return ctx.memory_limit - sum(p.numel() * p.element_size() for p in model.parameters())


def _time_fused(cache) -> list:
    """Wrap every BlockLayer's decode_attention with a pair of CUDA events; returns the list the pairs go to."""
    pairs = []
    for layer in _block_layers(cache):
        inner = layer.decode_attention

        def timed(*args, _inner=inner, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = _inner(*args, **kwargs)
            end.record()
            pairs.append((start, end))
            return out

        layer.decode_attention = timed
    return pairs


def _unwrap(cache) -> None:
    for layer in _block_layers(cache):
        layer.__dict__.pop("decode_attention", None)


@torch.no_grad()
def _decode_steps(model, cache, token: torch.Tensor, steps: int) -> tuple[list[float], torch.Tensor]:
    """`steps` greedy decode steps of the batch, each synchronized: (seconds per step, the last next tokens)."""
    device = token.device
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        token = logits[:, -1:].argmax(-1)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times, token


def _measure_row(model, kind: str, attn: str, out: dict, ctx: Context, L: int, B: int, counts: dict,
                 weights: int) -> None:
    """Fill a fresh cache of `kind` with `B` x `L` tokens, decode, and write what was measured into `out`."""
    from qcache import QuantCache
    from qcache.tools.footprint import reachable_bytes

    cuda = ctx.device.type == "cuda"
    warmup, steps, probe, chunk = counts["warmup"], counts["steps"], counts["probe"], counts["chunk"]
    cache = _make_cache(kind, model.config)
    model.set_attn_implementation(attn)
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device)
    start = time.perf_counter()
    fill(model, cache, B, L, chunk)
    _sync(ctx.device)
    out["fill_s"] = time.perf_counter() - start
    if cuda:
        out["held_allocated"] = torch.cuda.memory_allocated(ctx.device) - before
        out["peak_fill"] = torch.cuda.max_memory_allocated(ctx.device) - before
    out["formula"] = _formula_bytes(model.config, kind, L, B)
    if isinstance(cache, QuantCache):
        mem = cache.memory()
        # what the formula describes: memory() less preallocated capacity, the RoPE helper's tables and the
        # per-cache constants (levels, the rotation matrix)
        out["held_counted"] = mem.total
        out["counted_layout"] = mem.total - mem.reserved - mem.rope - mem.codebooks - mem.rotation
    else:
        out["held_counted"] = out["counted_layout"] = reachable_bytes(cache)
    token = random_ids(model, B, 1, seed=L + B).to(ctx.device)
    start = time.perf_counter()
    _, token = _decode_steps(model, cache, token, warmup)  # compiles the kernels of a new cache configuration
    out["warmup_s"] = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    times, token = _decode_steps(model, cache, token, steps)
    median = statistics.median(times)
    out.update({"steps": steps, "step_s_median": median, "step_s_min": min(times), "step_s_max": max(times),
                "tokens_per_s": B / median})
    if cuda:
        out["peak_decode"] = torch.cuda.max_memory_allocated(ctx.device) - before
    out["step_bytes"] = weights + out["counted_layout"]  # what one step reads at least: weights + the cache
    out["step_bytes_per_s"] = out["step_bytes"] / median
    if isinstance(cache, QuantCache):
        layers = _block_layers(cache)
        out["kernel"] = layers[0].kernel if layers else None
        out["decode_kernel"] = getattr(layers[0], "decode_kernel", None) if layers else None
        fused = _count_fused(cache)
        pairs = _time_fused(cache) if cuda else None
        _decode_steps(model, cache, token, probe)
        _unwrap(cache)
        out["fused_calls_per_step"] = fused[0] / probe
        if not cuda:
            out["fused_attention_skipped"] = "CUDA only (timed with CUDA events)"
        elif pairs:
            torch.cuda.synchronize(ctx.device)
            per_step = sum(s.elapsed_time(e) for s, e in pairs) / 1e3 / probe
            out["fused_attention_s_per_step"] = per_step
            out["fused_attention_bytes_per_s"] = out["counted_layout"] / per_step
        else:
            out["fused_attention_skipped"] = (f"no fused decode attention ran (kernel={out['kernel']!r}, "
                                              f"decode_kernel={out['decode_kernel']!r})")
    if out["formula"]:
        out["layout_vs_formula"] = out["counted_layout"] / out["formula"]
        if cuda:
            out["held_allocated_vs_formula"] = out["held_allocated"] / out["formula"]


def section_decode(sec: Section, ctx: Context) -> dict:
    """Decode tokens/s, memory and bandwidth per cache at one context and batch."""
    model = load(sec.model, ctx.device, ctx.dtype)
    L, B = sec.context, sec.batch
    if L > model.config.max_position_embeddings:
        raise ValueError(f"context {L} exceeds {sec.model}'s max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    counts = dict(warmup=2, steps=4, probe=2, chunk=128) if ctx.smoke else dict(warmup=3, steps=10, probe=3,
                                                                                   chunk=4096)
    chunk, cuda = counts["chunk"], ctx.device.type == "cuda"
    weights = weight_bytes_read(model)
    rows = []
    for label, (kind, attn) in DECODE_ROWS.items():
        out = {"row": label, "attention": attn, "context": L, "batch": B}
        missing = (_flash_attention_missing() if attn == "flash_attention_2" else
                   _quanto_missing(ctx.device) if kind == "quanto4" else None)
        if missing is None:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            need, free = _memory_estimate(model, kind, L, B, chunk), _available_bytes(model, ctx)
            out["memory_estimate"] = need["total"]
            if free is not None and need["total"] > free:
                missing = (f"memory: needs about {need['total'] / 2**30:.1f} GiB (cache {need['cache'] / 2**30:.1f} + "
                           f"transients {need['transient'] / 2**30:.1f}) beside the weights, "
                           f"{max(free, 0) / 2**30:.1f} GiB free")
        if missing is not None:
            out["skipped"] = missing
            rows.append(out)
            ctx.emit(out)
            continue
        try:
            _measure_row(model, kind, attn, out, ctx, L, B, counts, weights)
        except Exception as err:  # noqa: BLE001 - a row that fails (out of memory, say) is recorded, the next runs
            out["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:600]}"
            log.exception("row %s of %s", label, sec.name)
        base = next((r for r in rows if r["row"] == BASE_ROW and "tokens_per_s" in r), None)
        if "tokens_per_s" in out:
            out["vs_default"] = out["tokens_per_s"] / base["tokens_per_s"] if base else (
                1.0 if label == BASE_ROW else None)
            out["memory_vs_default"] = out["counted_layout"] / base["counted_layout"] if base else (
                1.0 if label == BASE_ROW else None)
        rows.append(out)
        ctx.emit(out)
    model.set_attn_implementation("sdpa")
    skipped = None if cuda else "torch.cuda.memory_allocated / max_memory_allocated: CUDA only"
    return {"context": L, "batch": B, "warmup_steps": counts["warmup"], "decode_steps": counts["steps"],
            "probe_steps": counts["probe"], "fill_chunk": chunk,
            "weight_bytes_read": weights, "rows": rows, "memory_skipped": skipped}


SECTION_FUNCTIONS = {"env": section_env, "paths": section_paths, "decode": section_decode}


# ---------------------------------------------------------------------------------------------------------------
# child: run sections in order, one JSON line per event
# ---------------------------------------------------------------------------------------------------------------


def _exit_with_parent(poll_s: float = 1.0) -> None:
    """Exit this process once its parent is gone (a killed parent leaves no section running on)."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def run_child(args: argparse.Namespace) -> None:
    """Run `args.sections` in order, appending events to `args.events` (start / row / done with result or error).
    The child runs in a process group of its own (the parent kills it as a group) and exits when the parent dies."""
    _exit_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_smoke:  # kernel="auto" would compile a probe on the CPU (tens of seconds): read eagerly
        os.environ.setdefault("QCACHE_KERNEL", "eager")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # eval.caches, qcache from this checkout
    import transformers  # noqa: F401 - imported before the first section starts its clock

    import qcache  # noqa: F401

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    dtype = torch.bfloat16
    by_name = {s.name: s for s in plan(args.cpu_smoke)}
    events = open(args.events, "a", buffering=1)

    def write(event: dict) -> None:
        events.write(json.dumps(event, default=str) + "\n")

    limit = args.memory_limit_gib * 2**30 if args.memory_limit_gib else None
    for name in args.sections:
        sec = by_name[name]
        write({"event": "start", "section": name, "t": time.time()})
        ctx = Context(args.cpu_smoke, device, dtype, tuple(args.paths), args.explicit_paths, limit,
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
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
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


def run_sections(args: argparse.Namespace, sections: list[Section],
                 on_change: Callable[[dict], None] = lambda records: None) -> dict[str, dict]:
    """Run `sections` in child processes, killing a child whose current section overruns its budget (or the total);
    one record per section: status ok / error / timeout / crashed / skipped, seconds, result or error, rows.
    `on_change(records)` is called whenever a record changed (the report is rewritten from it)."""
    records = {s.name: {"status": "pending", "budget_s": s.budget_s, "rows": []} for s in sections}
    pending = list(sections)
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
        cmd += ["--memory-limit-gib", str(args.memory_limit_gib)] if args.memory_limit_gib else []
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
            if events:
                on_change(records)
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
                    on_change(records)
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
        on_change(records)
    events_path.unlink(missing_ok=True)
    return records


def _f(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _mib(x) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.1f}"


def _gbps(x, copy: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x / 1e9:,.4g}" + (f" ({x / copy:.0%})" if copy else "")


def _copy_bandwidth(sections: dict) -> float | None:
    env = sections.get("env", {}).get("result") or {}
    return (env.get("copy_bandwidth") or {}).get("bytes_per_s")


def _decode_table(rows: list[dict], copy: float | None) -> list[str]:
    lines = ["| cache | attention | kernel / decode | tokens/s | vs default | step ms | fill s | warm-up s | held | "
             "counted | formula | held / formula | layout / formula | peak fill | peak decode | step GB/s | "
             "fused attn ms/step | fused attn GB/s |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
             "---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r or "error" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r['error']}"
            lines.append(f"| {r['row']} | {r['attention']} | {why[:200]} |" + " |" * 15)
            continue
        kernel = f"{r['kernel']} / {r.get('decode_kernel')}" if "kernel" in r else ""
        step = r.get("step_s_median")
        attn = r.get("fused_attention_s_per_step")
        lines.append(f"| {r['row']} | {r['attention']} | {kernel} | {_f(r.get('tokens_per_s'), ',.1f')} | "
                     f"{_f(r.get('vs_default'), '.2f')} | {_f(step * 1e3 if step else None, '.2f')} | "
                     f"{_f(r.get('fill_s'), '.1f')} | {_f(r.get('warmup_s'), '.1f')} | "
                     f"{_mib(r.get('held_allocated'))} | {_mib(r.get('held_counted'))} | {_mib(r.get('formula'))} | "
                     f"{_f(r.get('held_allocated_vs_formula'), '.3f')} | {_f(r.get('layout_vs_formula'), '.3f')} | "
                     f"{_mib(r.get('peak_fill'))} | {_mib(r.get('peak_decode'))} | "
                     f"{_gbps(r.get('step_bytes_per_s'), copy)} | {_f(attn * 1e3 if attn else None, '.3f')} | "
                     f"{_gbps(r.get('fused_attention_bytes_per_s'), copy)} |")
    return lines


def markdown(report: dict) -> str:
    """The report as markdown."""
    s = report["sections"]
    copy_bw = _copy_bandwidth(s)
    lines = [f"# GPU check{' (CPU smoke run)' if report['cpu_smoke'] else ''}", "", f"Command: `{report['command']}`",
             "", f"{report['started']}; {report['seconds']:.0f} s so far (budget {report['total_budget_s']:.0f} s); "
             f"git {report['git']}{'; finished' if report.get('finished') else '; still running (partial)'}.", "",
             "Models: configs of real geometry with random weights, bf16 (see the script's docstring).", "",
             "| section | status | seconds | budget s | note |", "|---|---|---:|---:|---|"]
    for name, rec in s.items():
        note = rec.get("error") or rec.get("reason") or ""
        lines.append(f"| {name} | {rec['status']} | {_f(rec.get('seconds'), '.1f')} | {rec['budget_s']:.0f} | "
                     f"{note[:160]} |")
    env = s.get("env", {}).get("result")
    if env:
        lines += ["", "## Environment", ""] + [f"- {k}: {v}" for k, v in env.items()]
    summary = []
    for name, rec in s.items():
        res = rec.get("result")
        if name.startswith("paths/") and res:
            lines += ["", f"## Read paths: {name.split('/')[1]}, QuantCache(bits={res['bits']}), {res['context']} "
                      "tokens", "",
                      "Same codes: one cache filled (kernel='eager') per attention, copied, and each copy read and "
                      "decoded one step by a path; compared with the eager read of the same codes (max |diff| / max "
                      f"|eager| over every layer's keys and values; agree within {READ_RTOL:.4f}) and the eager "
                      f"step's logits (agree: max |diff| <= {LOGITS_RTOL} x max |logits|). Fused calls: "
                      "BlockLayer.decode_attention calls (> 0: the step attended from the codes).", "",
                      "| path | attention | read max rel diff | reads agree | step logits max abs diff (scale) | "
                      "logits agree | same argmax | fused calls |", "|---|---|---:|:---:|---:|:---:|:---:|---:|"]
            for r in res["same_codes"]:
                lines.append(f"| {r['path']} | {r['attention']} | {_f(r['read_max_rel_diff'], '.2e')} | "
                             f"{r['reads_agree']} | {_f(r['step_logits_max_abs_diff'], '.3g')} "
                             f"({_f(r['logits_scale'], '.3g')}) | {r['logits_agree']} | {r['step_argmax_equal']} | "
                             f"{r['fused_decode_calls']} |")
            lines += ["", f"End to end: each path fills its own cache and decodes {res['decode_steps']} greedy tokens "
                      "(fills differ in the last bits, so codes may differ where a value sits on a rounding "
                      "boundary); logits compared up to the first differing token.", "",
                      "| path | vs | tokens equal | agree for | logits max abs diff (scale) | logits agree | "
                      "fused calls | seconds |", "|---|---|:---:|---:|---:|:---:|---:|---:|"]
            for r in res["end_to_end"]:
                diff = (f"{_f(r['logits_max_abs_diff'], '.3g')} ({_f(r['logits_scale'], '.3g')})"
                        if "logits_max_abs_diff" in r else "")
                lines.append(f"| {r['path']} | {r['reference'] or '-'} | {r.get('tokens_equal', '')} | "
                             f"{r.get('tokens_agree_for', '')} | {diff} | {r.get('logits_agree', '')} | "
                             f"{r['fused_decode_calls']} | {_f(r['seconds'], '.1f')} |")
            for path, why in res["skipped"].items():
                lines.append(f"| {path} | skipped: {why} | | | | | | |")
        if name.startswith("decode/") and (res or rec["rows"]):
            rows = res["rows"] if res else rec["rows"]
            _, model, context, batch = name.split("/")
            lines += ["", f"## Decode: {model}, {context} tokens, batch {batch[1:]}"
                      + ("" if res else f" (partial: {rec['status']})"), ""] + _decode_table(rows, copy_bw)
            if res and res.get("memory_skipped"):
                lines.append(f"\n(skipped: {res['memory_skipped']})")
            base = next((r for r in rows if r["row"] == BASE_ROW and "tokens_per_s" in r), None)
            for r in rows:
                if r["row"] != BASE_ROW and "tokens_per_s" in r:
                    summary.append(f"| {model} | {context} | {batch[1:]} | {r['row']} | "
                                   f"{_f(r['tokens_per_s'], ',.1f')} | "
                                   f"{_f(base['tokens_per_s'] if base else None, ',.1f')} | "
                                   f"{_f(r['tokens_per_s'] / base['tokens_per_s'] if base else None, '.2f')} | "
                                   f"{_f(r['counted_layout'] / base['counted_layout'] if base else None, '.3f')} |")
    if summary:
        lines += ["", "## Summary: each cache against DynamicCache (sdpa)", "",
                  "| model | context | batch | cache | tokens/s | default tokens/s | speed ratio | memory ratio |",
                  "|---|---:|---:|---|---:|---:|---:|---:|"] + summary
    lines += ["", "Decode tables: tokens/s = batch / median step (CUDA-synchronized, after warm-up); held: "
              "torch.cuda.memory_allocated growth over the fill; peaks: max_memory_allocated above the level before "
              "the fill (fill: random keys/values replayed through update() in chunks); formula: qcache.tools.size "
              "(qcache.layout.bytes_per_token; 16-bit for DynamicCache); counted: cache.memory() (qcache) or every "
              "reachable tensor; layout: counted less reserved capacity, the RoPE helper and per-cache constants "
              "(what the formula describes); MiB. step GB/s: (weights read + layout bytes) / median step; fused "
              "attn: BlockLayer.decode_attention per step (CUDA events) and layout bytes / that time; percentages "
              "are of the env section's device-to-device copy bandwidth."]
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
        >>> _budgets(["60", "env=5"], ["env", "paths/tiny-qwen2/4bit"])
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
                   help="run only these sections (default: all; names as in the report, e.g. "
                        "decode/llama3.1-8b/32768/b8)")
    p.add_argument("--paths", nargs="+", default=None, choices=list(PATHS),
                   help="read paths of the paths sections (default: all; on the CPU the compiled ones are skipped "
                        "unless named here)")
    p.add_argument("--total-budget", type=float, default=None,
                   help=f"seconds for the whole run (default {TOTAL_BUDGET_S}, or {SMOKE_BUDGET_S} with --cpu-smoke)")
    p.add_argument("--section-budget", nargs="+", default=None, metavar="[NAME=]SECONDS",
                   help="replace the per-section budgets: SECONDS for every section, or NAME=SECONDS for one")
    p.add_argument("--memory-limit-gib", type=float, default=None,
                   help="memory a decode row may plan on (default: the GPU's; none on the CPU): rows whose estimate "
                        "does not fit are skipped with it")
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
    if args.memory_limit_gib is not None and not args.memory_limit_gib > 0:
        parser.error(f"--memory-limit-gib {args.memory_limit_gib} must be a positive number of GiB")
    if args.total_budget is not None and not args.total_budget > 0:
        parser.error(f"--total-budget {args.total_budget} must be a positive number of seconds")
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
    sections = [Section(s.kind, budgets.get(s.name, budgets.get("*", s.budget_s)), s.model, s.bits, s.context,
                        s.batch) for s in sections]
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or pass --cpu-smoke for the CPU smoke run")
    args.total_budget = args.total_budget or (SMOKE_BUDGET_S if args.cpu_smoke else TOTAL_BUDGET_S)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(args.out or ("docs/results/gpu-check-cpu-smoke" if args.cpu_smoke else "docs/results/gpu-check"))
    out.parent.mkdir(parents=True, exist_ok=True)
    start, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
    report = {"command": "python bench/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "started": started, "seconds": 0.0, "total_budget_s": args.total_budget, "cpu_smoke": args.cpu_smoke,
              "git": _git(), "finished": False, "sections": {}}

    def write(records: dict, finished: bool = False) -> None:
        report.update(seconds=time.perf_counter() - start, sections=records, finished=finished)
        Path(f"{out}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        Path(f"{out}.md").write_text(markdown(report))

    records = run_sections(args, sections, on_change=write)
    write(records, finished=True)
    for name, rec in records.items():
        log.info("%-32s %-8s %s", name, rec["status"], (rec.get("error") or rec.get("reason") or "")[:120])
    print(f"wrote {out}.json, {out}.md; {report['seconds']:.0f} s")
    return report


if __name__ == "__main__":
    main()
