"""KV-cache sizing table: bytes per token, GiB at a context, requests that fit a memory budget, per format.

    python -m qcache.size smollm2-135m            (or --model smollm2-135m)
    python -m qcache.size path/to/model_dir --budget-gib 40 --request-tokens 32768
    python -m qcache.size --layers 32 --kv-heads 8 --head-dim 128 --context 131072 --json

Plain formats store every cached value at a fixed size; per token that is

    bytes/token = 2 (K and V) x layers x kv_heads x head_dim x bytes/value

| format | bytes/value | layout                                   |
|--------|-------------|------------------------------------------|
| 16-bit | 2           | fp16 / bf16                              |
| fp8    | 1           | e4m3 / e5m2, no scales                   |
| q8_0   | 1.0625      | llama.cpp: 32 int8 + one fp16 scale      |
| q4_0   | 0.5625      | llama.cpp: 32 4-bit + one fp16 scale     |

qcache rows come from `qcache.layout.bytes_per_token` (packed codes, scales/zeros, outliers, the full-precision
sink, recent and filling-block tokens, one position per row), so they depend on the context they are averaged over.

Sliding-window layers (`layer_types` with "sliding_attention") hold at most `sliding_window` tokens, so at long context they cost a constant; every "per token" figure here is total bytes / context. Under qcache
they follow `QuantCacheConfig.sliding_layers`: "native" keeps them in 16-bit, "quantized" quantizes them (key blocks),
"tokens" quantizes each token of their window on its own.

Units are binary: KiB = 1024 B, GiB = 1024**3 B.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qcache import layout
from qcache.config import SLIDING_MODES, SUPPORTED_BITS, QuantCacheConfig
from qcache.presets import recipe

__all__ = [
    "PLAIN_FORMATS",
    "QCACHE_FORMATS",
    "FORMATS",
    "KIB",
    "GIB",
    "DEFAULT_CONTEXT",
    "Geometry",
    "kv_bytes_per_token",
    "requests_that_fit",
    "crossover_tokens",
    "first_context_above",
    "cache_bytes",
    "size_table",
    "resolve_config_source",
    "load_config",
    "safetensors_param_count",
    "format_markdown",
    "main",
]

KIB = 1024
GIB = 1024**3
DEFAULT_CONTEXT = 131072  # with explicit geometry (no max_position_embeddings to read)

PLAIN_FORMATS = {  # name -> bytes per stored value
    "16-bit": 2.0,
    "fp8": 1.0,
    "q8_0": 34 / 32,  # llama.cpp block: 32 x int8 + fp16 scale
    "q4_0": 18 / 32,  # llama.cpp block: 32 x 4-bit + fp16 scale
}
QCACHE_FORMATS = {f"qcache-{b}bit": b for b in sorted(SUPPORTED_BITS, reverse=True)}  # name -> bits
FORMATS = (*PLAIN_FORMATS, *QCACHE_FORMATS)

# transformers layer_types QuantCache supports -> which kind of per-token KV the layer keeps (any other layer type is
# refused by QuantCache, and by this table)
LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a positive number")


# --- pure functions -------------------------------------------------------------------------------------------------


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_value: float) -> float:
    """Bytes one token adds to a plain K+V cache: 2 x layers x kv_heads x head_dim x bytes_per_value."""
    return 2 * layers * kv_heads * head_dim * bytes_per_value


def requests_that_fit(budget_bytes: float, bytes_per_request: float) -> int:
    """How many whole requests of `bytes_per_request` fit in `budget_bytes`: floor(budget / request)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be >= 0")
    _check_positive("bytes_per_request", bytes_per_request)
    return int(budget_bytes // bytes_per_request)


def crossover_tokens(weights_bytes: float, bytes_per_token: float) -> int:
    """Smallest context (tokens) whose cache, at a constant `bytes_per_token`, is larger than `weights_bytes`."""
    if weights_bytes < 0:
        raise ValueError(f"weights_bytes={weights_bytes!r} must be >= 0")
    _check_positive("bytes_per_token", bytes_per_token)
    return int(weights_bytes // bytes_per_token) + 1


def first_context_above(weights_bytes: float, bytes_at: Callable[[int], float], limit: int = 2**40) -> int | None:
    """Smallest context n with `bytes_at(n) > weights_bytes` (binary search; `bytes_at` must be non-decreasing), or
    None if even `limit` tokens stay at or below it (e.g. a model with only sliding-window layers)."""
    if bytes_at(limit) <= weights_bytes:
        return None
    lo, hi = 0, 1  # invariant: bytes_at(lo) <= weights (lo=0 means "no tokens"), bytes_at(hi) > weights once found
    while bytes_at(hi) <= weights_bytes:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bytes_at(mid) > weights_bytes:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True)
class Geometry:
    """The shape of a model's KV cache.

    Args:
        layers: layers that keep a per-token KV cache (full + sliding).
        kv_heads: key/value heads per layer.
        head_dim: channels per head.
        sliding_layers: how many of `layers` are sliding-window layers.
        sliding_window: tokens a sliding layer keeps at most (required when `sliding_layers` > 0).

    Example:
        >>> Geometry(layers=32, kv_heads=8, head_dim=128).full_layers
        32
    """

    layers: int
    kv_heads: int
    head_dim: int
    sliding_layers: int = 0
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _check_positive_int("layers", self.layers)
        _check_positive_int("kv_heads", self.kv_heads)
        _check_positive_int("head_dim", self.head_dim)
        if not isinstance(self.sliding_layers, int) or isinstance(self.sliding_layers, bool) or not (
            0 <= self.sliding_layers <= self.layers
        ):
            raise ValueError(f"sliding_layers={self.sliding_layers!r} must be an integer in [0, layers={self.layers}]")
        if self.sliding_window is not None:
            _check_positive_int("sliding_window", self.sliding_window)
        if self.sliding_layers and self.sliding_window is None:
            raise ValueError(f"sliding_layers={self.sliding_layers} needs a sliding_window (got None)")

    @property
    def full_layers(self) -> int:
        return self.layers - self.sliding_layers

    @classmethod
    def from_config(cls, config: Any) -> "Geometry":
        """Read the geometry from a transformers config (its text config for multimodal models).

        Layers come from `layer_types` when the config has it: "sliding_attention" layers are bounded by
        `sliding_window`; any other layer type is refused (QuantCache supports only these two). Without
        `layer_types`, all `num_hidden_layers` layers are sliding when the config sets a `sliding_window` (as
        transformers' cache does), full otherwise.
        """
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", None)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None)
        if not head_dim:
            hidden = getattr(text, "hidden_size", None)
            if not hidden or not heads:
                raise ValueError(
                    f"config has head_dim={head_dim!r}, hidden_size={hidden!r}, num_attention_heads={heads!r}: "
                    "cannot work out head_dim"
                )
            head_dim = hidden // heads
        v_head_dim = getattr(text, "v_head_dim", None)
        if v_head_dim and v_head_dim != head_dim:
            raise ValueError(
                f"config has keys of head_dim {head_dim} and values of v_head_dim {v_head_dim} "
                f"({getattr(text, 'model_type', '?')}); this table sizes keys and values of one width: measure such a "
                "model's cache with QuantCache.memory() instead")
        window = getattr(text, "sliding_window", None)

        layer_types = getattr(text, "layer_types", None)
        if layer_types is None:
            n = getattr(text, "num_hidden_layers", None)
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"config has num_hidden_layers={n!r}; need a positive integer")
            default = "sliding_attention" if window is not None else "full_attention"
            layer_types = [default] * n
        unknown = sorted(set(layer_types) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(f"config has layer_types {unknown}, which QuantCache does not support (nor this table); "
                             f"supported: {list(LAYER_KINDS)}")
        kinds = [LAYER_KINDS[t] for t in layer_types]
        sliding = kinds.count("sliding") if window is not None else 0  # no window: a "sliding" layer keeps everything
        layers = len(kinds)
        return cls(layers, kv_heads, head_dim, sliding, window if sliding else None)

    def describe(self) -> str:
        """One line, e.g. '26 layers (4 full, 22 sliding with window 512), 1 KV heads, head_dim 256'."""
        if self.sliding_layers:
            split = f"{self.full_layers} full, {self.sliding_layers} sliding with window {self.sliding_window}"
        else:
            split = f"{self.full_layers} full"
        return f"{self.layers} layers ({split}), {self.kv_heads} KV heads, head_dim {self.head_dim}"


def cache_bytes(geometry: Geometry, fmt: str, num_tokens: int,
                qcache: dict | None = None) -> tuple[float, float]:
    """Bytes one sequence of `num_tokens` tokens holds in `fmt`, as (full layers, sliding layers).

    `qcache` gives the qcache options other than the bit width (`QuantCacheConfig` fields), applied to the preset row
    of each width (`qcache.presets.recipe`); its `sliding_layers` decides whether sliding layers stay 16-bit
    ("native") or are quantized too.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not supported; allowed values: {list(FORMATS)}")
    _check_positive_int("num_tokens", num_tokens)
    g = geometry
    sliding_tokens = min(num_tokens, g.sliding_window) if g.sliding_layers else 0
    if fmt in PLAIN_FORMATS:
        bpv = PLAIN_FORMATS[fmt]
        full = kv_bytes_per_token(g.full_layers, g.kv_heads, g.head_dim, bpv) * num_tokens
        sliding = kv_bytes_per_token(g.sliding_layers, g.kv_heads, g.head_dim, bpv) * sliding_tokens
        return full, sliding
    cfg = recipe(bits=QCACHE_FORMATS[fmt], **(qcache or {}))
    full = layout.bytes_per_token(cfg, g.full_layers, g.kv_heads, g.head_dim, num_tokens) * num_tokens
    if not sliding_tokens:
        sliding = 0.0
    elif cfg.sliding_layers == "native":
        sliding = kv_bytes_per_token(g.sliding_layers, g.kv_heads, g.head_dim, PLAIN_FORMATS["16-bit"]) * sliding_tokens
    else:
        layer = dataclasses.replace(cfg.for_sliding_layer(0), sink_tokens=0)  # sliding layers keep no sinks
        if layer.holds_window_only():  # the whole window as tokens quantized one by one, no key blocks
            layer.check_head_dim(g.head_dim)
            positions = 8  # the int64 position of the row's first token, per layer
            sliding = g.sliding_layers * (g.kv_heads * sliding_tokens * layout.token_bytes(layer, g.head_dim) + positions)
        else:
            sliding = layout.bytes_per_token(layer, g.sliding_layers, g.kv_heads, g.head_dim, sliding_tokens) * sliding_tokens
    return full, sliding


def size_table(geometry: Geometry, context: int, budget_bytes: float = 24 * GIB, request_tokens: int = 8192,
               weights_bytes: float | None = None, formats: Sequence[str] = FORMATS,
               qcache: dict | None = None) -> list[dict]:
    """One row per format: bytes/token (averaged over `context`), GiB at `context` (full / sliding layers and total),
    requests of `request_tokens` that fit in `budget_bytes`, and, given `weights_bytes`, the context at which the
    cache grows larger than the weights.

    Example:
        >>> size_table(Geometry(32, 8, 128), 131072, formats=["16-bit"])[0]["gib_at_context"]
        16.0
    """
    _check_positive_int("context", context)
    _check_positive_int("request_tokens", request_tokens)
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be >= 0")
    if weights_bytes is not None:
        _check_positive("weights_bytes", weights_bytes)
    rows = []
    for fmt in formats:
        full, sliding = cache_bytes(geometry, fmt, context, qcache)
        per_request = sum(cache_bytes(geometry, fmt, request_tokens, qcache))
        row = {
            "format": fmt,
            "bytes_per_value": PLAIN_FORMATS.get(fmt),  # None for qcache (depends on the context)
            "bytes_per_token": (full + sliding) / context,
            "kib_per_token": (full + sliding) / context / KIB,
            "context": context,
            "full_gib": full / GIB,
            "sliding_gib": sliding / GIB,
            "gib_at_context": (full + sliding) / GIB,
            "request_tokens": request_tokens,
            "bytes_per_request": per_request,
            "requests_that_fit": requests_that_fit(budget_bytes, per_request),
        }
        if weights_bytes is not None:
            row["crossover_tokens"] = first_context_above(
                weights_bytes, lambda n, fmt=fmt: sum(cache_bytes(geometry, fmt, n, qcache)))
        rows.append(row)
    return rows


# --- config and weights on disk -------------------------------------------------------------------------------------


def resolve_config_source(source: str) -> Path:
    """An existing directory or config.json path as is; anything else is a short model name for
    `qcache.tools.models.resolve_model` (imported here, so this module works without it)."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    if source.endswith(".json") or source.startswith((".", "/", "~")) or "\\" in source:
        raise ValueError(f"model path {source!r} does not exist")
    try:
        from qcache.tools.models import resolve_model
    except ImportError as err:
        raise ValueError(
            f"{source!r} is not an existing path, and short model names need qcache.tools.models ({err})"
        ) from err
    try:
        resolved = Path(resolve_model(source))
    except (KeyError, ValueError, OSError) as err:
        raise ValueError(f"{source!r} is neither an existing path nor a known model name: {err}") from err
    if not resolved.exists():
        raise ValueError(f"model {source!r} resolved to {str(resolved)!r}, which does not exist")
    return resolved


def load_config(path: str | Path) -> Any:
    """`AutoConfig` from a local model directory or config.json file (no network)."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"cannot read a transformers config from {str(path)!r}: {err}") from err


def safetensors_param_count(model_dir: str | Path) -> int | None:
    """Parameters stored in `model_dir`'s *.safetensors files, read from their headers (no tensor is loaded);
    None when there are none."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                total += math.prod(f.get_slice(name).get_shape())
    return total


# --- CLI ------------------------------------------------------------------------------------------------------------


def _cell(value: float | int | None, decimals: int) -> str:
    if value is None:
        return "never"
    return f"{value:.{decimals}f}" if decimals else f"{round(value)}"


def format_markdown(rows: list[dict], budget_gib: float) -> str:
    """The rows of `size_table` as a markdown table (sliding columns only when some layer is sliding)."""
    if not rows:
        return ""
    context, request = rows[0]["context"], rows[0]["request_tokens"]
    sliding = any(r["sliding_gib"] for r in rows)
    weights = "crossover_tokens" in rows[0]
    columns = [("format", lambda r: r["format"], False),
               ("B/token", lambda r: _cell(r["bytes_per_token"], 0), True),
               ("KiB/token", lambda r: _cell(r["kib_per_token"], 2), True)]
    if sliding:
        columns += [(f"full layers GiB @ {context}", lambda r: _cell(r["full_gib"], 2), True),
                    (f"sliding layers GiB @ {context}", lambda r: _cell(r["sliding_gib"], 2), True)]
    columns += [(f"GiB @ {context}", lambda r: _cell(r["gib_at_context"], 2), True),
                (f"requests of {request} in {budget_gib:g} GiB", lambda r: str(r["requests_that_fit"]), True)]
    if weights:
        columns += [("passes weights at (tokens)", lambda r: _cell(r["crossover_tokens"], 0), True)]
    cells = [[get(r) for _, get, _ in columns] for r in rows]
    widths = [max(len(name), *(len(c[i]) for c in cells)) for i, (name, _, _) in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "| " + " | ".join(
            v.rjust(w) if right else v.ljust(w) for v, w, (_, _, right) in zip(values, widths, columns)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if right else ("-" * (w + 2))
                          for w, (_, _, right) in zip(widths, columns)) + "|"
    return "\n".join([line([name for name, _, _ in columns]), rule, *(line(c) for c in cells)])


def _parser() -> argparse.ArgumentParser:
    defaults = QuantCacheConfig()
    p = argparse.ArgumentParser(
        prog="python -m qcache.size",
        description="KV-cache size per format: bytes/token, GiB at a context, requests that fit a budget. "
                    "Binary units (KiB = 1024 B, GiB = 1024**3 B).")
    p.add_argument("model", nargs="?", default=None,
                   help="short model name (e.g. smollm2-135m, gemma3-270m), a local HF model directory, or a "
                        "config.json path; or give --layers/--kv-heads/--head-dim instead")
    p.add_argument("--model", dest="model_option", metavar="MODEL", default=None,
                   help="the same as the positional MODEL")
    p.add_argument("--layers", type=int, help="explicit geometry: layers with a KV cache")
    p.add_argument("--kv-heads", type=int, help="explicit geometry: key/value heads per layer")
    p.add_argument("--head-dim", type=int, help="explicit geometry: channels per head")
    p.add_argument("--sliding-layers", type=int, default=0,
                   help="explicit geometry: how many of --layers are sliding-window layers (default 0)")
    p.add_argument("--sliding-window", type=int, help="explicit geometry: tokens a sliding layer keeps")
    p.add_argument("--context", type=int,
                   help=f"context length in tokens (default: the model's max_position_embeddings, or "
                        f"{DEFAULT_CONTEXT} with explicit geometry)")
    p.add_argument("--budget-gib", type=float, default=24.0, help="KV-cache memory budget in GiB (default 24)")
    p.add_argument("--request-tokens", type=int, default=8192,
                   help="tokens per request when counting requests that fit the budget (default 8192)")
    p.add_argument("--weights-gib", type=float,
                   help="weights size in GiB, to show the context at which each cache passes it (default: counted "
                        "from the model directory's safetensors headers, 2 bytes per parameter)")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS), metavar="FORMAT",
                   help=f"rows to show (default: all); choices: {', '.join(FORMATS)}")
    p.add_argument("--k-group-size", type=int, default=defaults.k_group_size,
                   help=f"qcache: tokens per key block (default {defaults.k_group_size})")
    p.add_argument("--v-group-size", type=int, default=defaults.v_group_size,
                   help="qcache: channels per value group; must divide head_dim (default: the largest multiple of 8 "
                        "up to 64 that divides head_dim)")
    p.add_argument("--qcache-sliding", choices=SLIDING_MODES, default=defaults.sliding_layers,
                   help=f"qcache: keep sliding layers 16-bit ('native') or quantize them "
                        f"(default {defaults.sliding_layers!r})")
    p.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    return p


def _run(args: argparse.Namespace) -> dict:
    """Everything main prints, as a dict; raises ValueError on bad input."""
    if args.model is not None and args.model_option is not None and args.model != args.model_option:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_option!r}")
    args.model = args.model or args.model_option
    explicit = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    given = [name for name, value in explicit.items() if value is not None]
    weights_bytes = None
    weights_source = None
    if args.model is not None:
        if given or args.sliding_layers or args.sliding_window is not None:
            raise ValueError(f"give either a model ({args.model!r}) or explicit geometry, not both")
        path = resolve_config_source(args.model)
        config = load_config(path)
        geometry = Geometry.from_config(config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        context = args.context or getattr(text, "max_position_embeddings", None) or DEFAULT_CONTEXT
        params = safetensors_param_count(path if path.is_dir() else path.parent)
        if params is not None:
            weights_bytes, weights_source = params * 2, f"{params} parameters x 2 B from safetensors"
        name = args.model
    else:
        if len(given) < 3:
            missing = [name for name in explicit if name not in given]
            raise ValueError(f"explicit geometry needs --layers, --kv-heads and --head-dim; missing {missing} "
                             "(or give a model name/path)")
        geometry = Geometry(args.layers, args.kv_heads, args.head_dim, args.sliding_layers, args.sliding_window)
        context = args.context if args.context is not None else DEFAULT_CONTEXT
        name = None
    if args.weights_gib is not None:
        _check_positive("--weights-gib", args.weights_gib)
        weights_bytes, weights_source = args.weights_gib * GIB, "--weights-gib"
    _check_positive("--budget-gib", args.budget_gib)
    qcache = {"k_group_size": args.k_group_size, "v_group_size": args.v_group_size,
              "sliding_layers": args.qcache_sliding}
    recipe(**qcache)  # refused here, before any row, if the options do not hold together
    rows = size_table(geometry, context, args.budget_gib * GIB, args.request_tokens, weights_bytes,
                      args.formats, qcache)
    return {
        "model": name,
        "geometry": dataclasses.asdict(geometry),
        "context": context,
        "budget_gib": args.budget_gib,
        "request_tokens": args.request_tokens,
        "weights_bytes": weights_bytes,
        "weights_source": weights_source,
        "qcache": qcache,
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        result = _run(args)
    except ValueError as err:
        parser.error(str(err))  # exits with status 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    geometry = Geometry(**result["geometry"])
    head = f"{result['model']}: " if result["model"] else ""
    print(f"{head}{geometry.describe()}; context {result['context']} tokens; "
          f"bytes/token averaged over the context.")
    if result["weights_bytes"] is not None:
        print(f"Weights: {result['weights_bytes'] / GIB:.2f} GiB ({result['weights_source']}).")
    print()
    print(format_markdown(result["rows"], result["budget_gib"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
