"""lm-eval model adapter: an `HFLM` whose forward passes and generations go through a chosen KV cache.

    lm-eval path              what the adapter does
    ------------------------  --------------------------------------------------------------------------------
    loglikelihood(_rolling)   `_model_call`: a fresh cache; the input fed `chunk_size` tokens at a time through it
                              (use_cache=True), so every later chunk attends to what the cache stored
    generate_until            `_model_generate`: the prompt prefilled the same way into a fresh cache, then
                              `generate(cache=<that cache>)` decodes every new token from it

Every forward is checked to have written its tokens into the cache the adapter built (`CacheNotWrittenError`
otherwise): a model that ignores `cache=` would build a full-precision cache of its own and the row labelled with
the quantized cache would measure the default one.

`--model_args` choose the cache (everything else goes to `HFLM`):

    pretrained=<short name | dir | hub id>   short names (`smollm2-135m`, `gemma3-270m`) resolve offline
    cache=default|quant|hf-quanto|hf-hqq|hf-fp8
    bits=, k_bits=, v_bits=, calibration=<file>, and any other `QuantCacheConfig` field (quant only)
    chunk_size=256                            tokens per forward pass through the cache
    attn_implementation=qcache_fp32           attention accumulating in fp32 (qcache.attention), e.g. with
                                              dtype=bfloat16; HFLM passes it to from_pretrained

Example:
    >>> lm = QCacheLM(pretrained="smollm2-135m", cache="quant", bits=4, device="cpu")  # doctest: +SKIP
    >>> lm.cache_updates  # Cache.update calls so far (one per layer per forward)            # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import logging

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("the lm-eval adapter needs lm-eval: pip install 'lm_eval[ruler]' (or 'qcache[eval]')") from err

from qcache._compat import check_transformers, require_cache_written
from qcache.caches import CACHE_KINDS, build_cache, cache_label
from qcache.config import QuantCacheConfig
from qcache.models import resolve_model

__all__ = ["QCacheLM", "CACHE_OPTIONS", "chunk_bounds", "parse_cache_options"]

logger = logging.getLogger(__name__)

# QuantCacheConfig fields a user may set (`extra` is internal), plus the calibration file
CACHE_OPTIONS = tuple(f.name for f in dataclasses.fields(QuantCacheConfig) if f.name != "extra") + ("calibration",)
_INT_OPTIONS = {f.name for f in dataclasses.fields(QuantCacheConfig) if "int" in str(f.type)}
_BOOL_OPTIONS = {f.name for f in dataclasses.fields(QuantCacheConfig) if str(f.type) in ("bool", "bool | None")}
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _to_int(name: str, value) -> int | None:
    """An int option as lm-eval may hand it over: int, digit string, or None/"none"."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"{name}={value!r} must be an integer")


def _to_bool(name: str, value) -> bool | None:
    """A bool option as lm-eval may hand it over: bool, 0/1, or true/false/yes/no in any case."""
    if value is None or isinstance(value, bool):
        return value
    key = str(value).strip().lower()
    if key in ("", "none"):
        return None
    if key not in _BOOLS:
        raise ValueError(f"{name}={value!r} must be a boolean (true/false)")
    return _BOOLS[key]


def parse_cache_options(options: dict) -> tuple[int | None, dict]:
    """Split `--model_args` cache options into (bits, other options), with ints and bools parsed.

    Example:
        >>> parse_cache_options({"bits": "4", "recent_tokens": "0", "rope": "post", "static_keys": "false"})
        (4, {'recent_tokens': 0, 'rope': 'post', 'static_keys': False})
    """
    unknown = sorted(set(options) - set(CACHE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown cache options {unknown}; allowed: {sorted(CACHE_OPTIONS)}")
    parsed = {}
    for name, value in options.items():
        if name in _INT_OPTIONS:
            value = _to_int(name, value)
        elif name in _BOOL_OPTIONS:
            value = _to_bool(name, value)
        if value is not None:
            parsed[name] = str(value) if name == "calibration" else value
    return parsed.pop("bits", None), parsed


def chunk_bounds(length: int, chunk: int, align: int = 8) -> list[tuple[int, int]]:
    """[start, end) of the pieces fed through the cache: `chunk` tokens each; a last partial piece is cut at a
    multiple of `align` (the rest, under `align` tokens, goes last on its own).

    Why: Transformers' HQQ cache re-quantizes the whole cache whenever a piece fills its residual, and hqq's
    2-/4-bit packing fails unless kv_heads * tokens * head_dim / 64 is a multiple of 4 / 2; with every re-quantized
    length a multiple of 8 it holds. The other caches read the same tokens either way.

    Example:
        >>> chunk_bounds(600, 256)
        [(0, 256), (256, 512), (512, 600)]
        >>> chunk_bounds(525, 256)
        [(0, 256), (256, 512), (512, 520), (520, 525)]
    """
    bounds = [(start, min(start + chunk, length)) for start in range(0, length, chunk)]
    start, end = bounds[-1] if bounds else (0, 0)
    cut = start + (end - start) // align * align
    if start < cut < end:
        bounds[-1:] = [(start, cut), (cut, end)]
    return bounds


@register_model("qcache")
class QCacheLM(HFLM):
    """`HFLM` routing log-likelihood and generation through a fresh cache of the chosen kind per request batch.

    Args:
        pretrained: a short name from `qcache.models.MODELS`, a local HF directory or a hub id.
        cache: one of `qcache.caches.CACHE_KINDS`.
        chunk_size: tokens per forward pass through the cache (log-likelihood and prefill).
        **kwargs: cache options (`bits`, `k_bits`, `v_bits`, `calibration`, any `QuantCacheConfig` field) and
            `HFLM` arguments (`batch_size`, `dtype`, `max_length`, ...).

    Example:
        >>> lm = QCacheLM(pretrained="smollm2-135m", cache="quant", bits=2, device="cpu")  # doctest: +SKIP
        >>> lm.loglikelihood_rolling(requests)                                              # doctest: +SKIP
    """

    def __init__(self, pretrained="smollm2-135m", cache: str = "default", chunk_size: int = 256, **kwargs):
        check_transformers()
        if isinstance(pretrained, str):
            pretrained = resolve_model(pretrained)
        if isinstance(kwargs.get("tokenizer"), str):
            kwargs["tokenizer"] = resolve_model(kwargs["tokenizer"])
        if kwargs.get("device") in (None, "cuda") and not torch.cuda.is_available():
            kwargs["device"] = "cpu"
        if kwargs.get("attn_implementation") == "qcache_fp32":  # fp32-accumulating attention for bf16/fp16 models
            from qcache.attention import register_fp32_attention

            register_fp32_attention()
        cache_options = {name: kwargs.pop(name) for name in CACHE_OPTIONS if name in kwargs}
        super().__init__(pretrained=pretrained, **kwargs)
        self.chunk_size = _to_int("chunk_size", chunk_size)
        if self.chunk_size is None or self.chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer")
        self.cache_updates = 0  # Cache.update calls received by the caches this adapter built
        self.caches_built = 0
        self.last_cache = None
        self.set_cache(cache, **cache_options)

    # -- the cache -------------------------------------------------------------------------------------------
    def set_cache(self, cache: str = "default", **options) -> None:
        """Choose the cache for the next requests (validated now, by building one)."""
        if cache not in CACHE_KINDS:
            raise ValueError(f"cache={cache!r} is not supported; allowed values: {list(CACHE_KINDS)}")
        bits, options = parse_cache_options(options)
        build_cache(cache, self.model.config, bits, **dict(options))
        self.cache_kind, self.cache_bits, self.cache_options = cache, bits, options
        logger.info("KV cache: %s", self.cache_label)

    @property
    def cache_label(self) -> str:
        return cache_label(self.cache_kind, self.cache_bits, **self.cache_options)

    def _new_cache(self):
        """A fresh cache of the chosen kind whose `update` calls are counted in `self.cache_updates`."""
        cache = build_cache(self.cache_kind, self.model.config, self.cache_bits, **dict(self.cache_options))
        update = cache.update
        counter = self  # not named `self` inside the wrapper: QuantCache inspects callers' `self` on the stack

        def counted_update(*args, **kwargs):
            counter.cache_updates += 1
            return update(*args, **kwargs)

        cache.update = counted_update  # an instance attribute: called as cache.update(key, value, layer_idx, ...)
        self.caches_built += 1
        self.last_cache = cache  # for inspection (e.g. QuantCache.memory())
        return cache

    # -- lm-eval hooks ---------------------------------------------------------------------------------------
    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits [B, L, V] of `inps` [B, L], read `chunk_size` tokens at a time through one fresh cache."""
        if attn_mask is not None or labels is not None:
            raise NotImplementedError("QCacheLM supports decoder-only (causal) models")
        cache = self._new_cache()
        held = cache.get_seq_length()
        logits = []
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            for start, end in chunk_bounds(inps.shape[1], self.chunk_size):
                piece = inps[:, start:end]  # [B, c]
                logits.append(self.model(piece, cache=cache, use_cache=True).logits)  # [B, c, V]
                held = require_cache_written(cache, held, end - start, f"log-likelihood, tokens {start}:{end}")
        return torch.cat(logits, dim=1)  # [B, L, V]

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """HFLM's generation from a fresh cache into which the prompt [B, L] (left-padded) was prefilled in the
        pieces of `chunk_bounds` (all but its last token, which `generate` feeds itself before decoding)."""
        mask = generation_kwargs.get("attention_mask")
        if mask is None:
            mask = generation_kwargs["attention_mask"] = torch.ones_like(context)
        # positions as generate() computes them: padding gets 0, real tokens count from 0
        positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [B, L]
        cache = self._new_cache()
        held = cache.get_seq_length()
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            for start, end in chunk_bounds(context.shape[1] - 1, self.chunk_size):
                self.model(context[:, start:end], attention_mask=mask[:, :end], position_ids=positions[:, start:end],
                           cache=cache, use_cache=True, logits_to_keep=1)
                held = require_cache_written(cache, held, end - start, f"prefill, tokens {start}:{end}")
        out = super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)  # [B, L']
        # generate fed the last prompt token and every new token but the last one
        require_cache_written(cache, held, out.shape[1] - 1 - held, "generate")
        return out

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update(kv_cache=self.cache_label, kv_cache_kind=self.cache_kind, kv_cache_bits=self.cache_bits,
                    kv_cache_options=dict(self.cache_options), chunk_size=self.chunk_size)
        return info
