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

import logging

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("the lm-eval adapter needs lm-eval: pip install 'lm_eval[ruler]' (or 'qcache[eval]')") from err

from qcache._compat import check_transformers, require_cache_written
from eval.caches import CACHE_KINDS, build_cache, cache_label
from qcache.tools.models import resolve_model

from .options import CACHE_OPTIONS, chunk_bounds, parse_cache_options, to_int

__all__ = ["QCacheLM", "CACHE_OPTIONS", "chunk_bounds", "parse_cache_options"]

logger = logging.getLogger(__name__)

@register_model("qcache")
class QCacheLM(HFLM):
    """`HFLM` routing log-likelihood and generation through a fresh cache of the chosen kind per request batch.

    Args:
        pretrained: a short name from `qcache.tools.models.MODELS`, a local HF directory or a hub id.
        cache: one of `eval.caches.CACHE_KINDS`.
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
        self.chunk_size = to_int("chunk_size", chunk_size)
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
        if "bits_per_value" in options:
            raise ValueError(f"bits_per_value={options['bits_per_value']} is chosen by calibrating: run python -m "
                             "qcache.calibrate --bits-per-value B --out FILE first; allowed here: calibration=FILE")
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
