"""Attention that accumulates in fp32 whatever the model dtype.

Attention over n keys is a weighted sum of n values. Summed in bf16 (8 significant bits), a running sum of n equal
weights 1/n stops growing after 256 terms: at n = 131072 it keeps 256/n = 0.2 % of the mass (fp16, 11 bits: 2048
terms). A quantized cache makes long contexts affordable, so its attention must not lose them in the sum.

What stock attention gives on CPU (torch 2.13, transformers 5.24; read from the source and measured with the
flat-attention test of tests/test_attention.py, bf16, n = 131072, all scores equal):

    ======================= ========================================================= ====================
    implementation          what it does in bf16                                      measured here
    ======================= ========================================================= ====================
    "sdpa", flash CPU       scores, max, sum and the output in fp32 (`accum_t =        mean(V) within bf16
    kernel (the default)    opmath_type<scalar_t>` in FlashAttentionKernel.cpp);       output rounding
                            probabilities rounded to bf16 before P @ V
    "sdpa", math kernel     upcasts q/k/v to fp32 unless                               mean(V) within bf16
    (when flash can't run)  `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp`   output rounding
                            (a process-wide flag, also read on CPU) allows bf16
    "eager"                 softmax in fp32, then rounded to bf16; `matmul(P, V)` in   mean(V) within bf16
                            bf16: oneDNN/MKL accumulate in fp32 on this CPU, but the   output rounding
                            accumulator of a bf16 matmul is the BLAS library's choice
                            (cuBLAS may reduce in bf16: `allow_bf16_reduced_precision_
                            reduction` defaults to True)
    ======================= ========================================================= ====================

So stock attention happens to accumulate in fp32 on this CPU, but nothing in its API promises it: which SDPA kernel
runs, one global flag, and the BLAS backend decide. `fp32_sdpa_attention_forward` makes it a property of the code:
q/k/v are upcast to fp32, torch SDPA runs on fp32 inputs (every kernel accumulates fp32 in fp32; the probabilities
are not rounded to bf16 either), and the output is cast back to the model dtype.

Usage (registered under the name "qcache_fp32", with transformers' sdpa mask builder):

    >>> use_fp32_attention(model)                      # doctest: +SKIP
    >>> model.generate(**inputs, cache=QuantCache(bits=4))  # doctest: +SKIP

or `from_pretrained(..., attn_implementation="qcache_fp32")` after `register_fp32_attention()`.

At a decode step a `QuantCache` whose kernel is "compiled" hands attention a `HeldStates` pair (qcache/handover.py)
instead of dequantized keys and values; this function, like stock sdpa, lets the layer attend from its codes in fp32
(`BlockLayer.decode_attention`). Anything else that reaches it with them (more than one query token, a softcap, a
position bias) gets the layer's keys and values as `update()` returns them otherwise.
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn.functional as F

from .handover import HeldStates

__all__ = ["ATTN_IMPLEMENTATION", "fp32_sdpa_attention_forward", "register_fp32_attention", "use_fp32_attention"]

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "qcache_fp32"


# ---------------------------------------------------------------------------------------------------------------
# GQA and masks
# ---------------------------------------------------------------------------------------------------------------

def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, Hkv * n_rep, T, D]; query head h reads kv head h // n_rep (as transformers' repeat_kv)."""
    if n_rep == 1:
        return x
    B, H, T, D = x.shape
    return x[:, :, None].expand(B, H, n_rep, T, D).reshape(B, H * n_rep, T, D)


def _fold_bias(
    position_bias: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, q_len: int, k_len: int
) -> torch.Tensor:
    """An additive fp32 mask: `position_bias` where attention is allowed, the fp32 minimum elsewhere (finite, so a
    fully masked row, e.g. a left-pad query, gives no NaN; as stock sdpa does)."""
    bias = position_bias.float()
    if mask is None and is_causal:  # upper-left causal, as SDPA's is_causal
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=bias.device).tril()[None, None]  # [1, 1, Tq, Tk]
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, torch.finfo(bias.dtype).min)
    return bias + mask


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
    is_causal: bool, softcap: float, dropout: float,
) -> torch.Tensor:
    """fp32 attention with `softcap * tanh(scores / softcap)` before the mask (Gemma 2's eager order).

    q: [B, H, Tq, D], k/v: [B, H, Tk, D] (GQA already expanded) -> [B, H, Tq, D]."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Tq, Tk]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        # finite minimum as eager's masks: a fully masked row (a left-pad query) gives no NaN
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1)
    if dropout > 0.0:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


# ---------------------------------------------------------------------------------------------------------------
# the attention function
# ---------------------------------------------------------------------------------------------------------------

def fp32_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (the signature of its "sdpa" one) computing in fp32.

    Args:
        module: the calling attention module (`is_causal` is read from it when not passed).
        query: [B, Hq, Tq, D]; key / value: [B, Hkv, Tk, D] with Hq a multiple of Hkv (GQA / MQA), any float dtype.
        attention_mask: None, a bool mask (True = attend) or an additive float mask, broadcastable to
            [B, Hq, Tq, Tk]; the sliding window of sliding layers is already in it (the `sliding_window` kwarg is
            accepted and, as by stock sdpa, not needed).
        dropout: attention dropout probability (the module passes 0.0 outside training).
        scaling: score scale (default 1/sqrt(D)).
        is_causal: as for stock sdpa; only used when there is no mask and Tq > 1.
        position_bias: additive bias [B or 1, Hq, Tq, Tk] (T5-style models), folded into the mask in fp32.
        softcap: attention logit soft-capping (Gemma 2). Stock sdpa raises on it; here it runs as explicit fp32
            math (scores, tanh cap, mask, softmax, P @ V), which materializes the [Tq, Tk] scores.

    Returns:
        (output [B, Tq, Hq, D] in query's dtype, None): attention weights are not returned (as stock sdpa).

    Example:
        >>> out, _ = fp32_sdpa_attention_forward(module, q, k, v, None)   # doctest: +SKIP
    """
    if kwargs.get("s_aux") is not None:
        raise ValueError(
            "qcache_fp32 attention does not support attention sinks (s_aux, e.g. gpt-oss); allowed: s_aux=None "
            "(use attn_implementation='eager' for such models)"
        )
    if kwargs.get("output_attentions", False):
        warnings.warn("qcache_fp32 attention does not return attention weights (output_attentions=True is ignored)",
                      stacklevel=2)
    out_dtype = query.dtype
    B, Hq, Tq, D = query.shape
    if isinstance(key, HeldStates):  # a QuantCache decode step: attend from the codes (qcache/handover.py)
        Hkv = key.shape[1]
        if Tq == 1 and softcap is None and position_bias is None and dropout == 0.0 and key.step.live:
            out = key.step.attend(query.reshape(B, Hkv, Hq // Hkv, D), attention_mask, scaling)  # fp32
            return out.reshape(B, Hq, 1, D).transpose(1, 2).contiguous().to(out_dtype), None
        key, value = key.dense(), value.dense()  # anything else: the keys/values update() returns otherwise
    Hkv = key.shape[1]
    if Hq % Hkv:
        raise ValueError(f"query has {Hq} heads, key/value {Hkv}: the query heads must be a multiple of the kv heads")
    n_rep = Hq // Hkv

    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.float()  # additive masks: fp32 like the scores (bf16 min is still -3.4e38)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(Tq > 1 and mask is None and is_causal)
    if is_causal and key.shape[2] > Tq:
        # no mask and more keys than queries: only an empty static cache's prefill gets here (the sdpa mask builder
        # skips the mask only when Tq == 1 or Tk == Tq otherwise); its keys past Tq are empty, as stock sdpa assumes
        key, value = key[:, :, :Tq], value[:, :, :Tq]
        position_bias = position_bias[..., :Tq] if position_bias is not None else None
    q, k, v = query.float(), key.float(), value.float()  # the fp32 copies (none for an fp32 model)
    if position_bias is not None:
        mask = _fold_bias(position_bias, mask, is_causal, Tq, k.shape[2])
        is_causal = False

    if softcap is not None:
        out = _softcapped_attention(q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), mask, scaling, is_causal,
                                    softcap, dropout)
    elif n_rep > 1 and Tq == 1 and (mask is None or mask.shape[1] == 1):
        # decode: the n_rep query heads sharing a kv head become n_rep queries of that head, no K/V copy. (Stock
        # sdpa passes enable_gqa=True when there is no mask: the CPU flash kernel then takes ~8x longer for one
        # query, 12 ms vs 1.4 ms per layer at 8k tokens, SmolLM2 geometry, measured)
        # q: [B, Hq, 1, D] -> [B, Hkv, n_rep, D]; a mask [B, 1, 1, Tk] broadcasts over them
        out = F.scaled_dot_product_attention(q.reshape(B, Hkv, n_rep, D), k, v, attn_mask=mask, dropout_p=dropout,
                                             scale=scaling)
        out = out.reshape(B, Hq, 1, D)  # [B, Hkv, n_rep, D] -> [B, Hq, 1, D]
    else:
        # enable_gqa: no n_rep-fold fp32 copy of K/V (as fast as repeat_kv for prefill on CPU, measured)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             is_causal=is_causal, enable_gqa=n_rep > 1)
    # [B, Hq, Tq, D] -> [B, Tq, Hq, D], the layout attention modules reshape into hidden states
    return out.transpose(1, 2).contiguous().to(out_dtype), None


# ---------------------------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------------------------

def register_fp32_attention() -> str:
    """Register "qcache_fp32" in transformers' attention and attention-mask interfaces; return the name.

    The mask builder is the one of "sdpa" (bool masks, skipped when SDPA's `is_causal` suffices): an attention
    function registered without one gets `attention_mask=None` from transformers, i.e. no causal, padding or
    sliding-window mask at all. Idempotent."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:
        from ._compat import TransformersVersionError, binding_context

        raise TransformersVersionError(
            f"qcache registers its attention in transformers' AttentionInterface and AttentionMaskInterface (with "
            f"the sdpa mask builder) and could not import them ({binding_context()}): {err}"
        ) from err
    AttentionInterface.register(ATTN_IMPLEMENTATION, fp32_sdpa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def use_fp32_attention(model):
    """Switch `model` (and its sub-models) to fp32-accumulating attention, in place; returns the model.

    Raises ValueError for a model whose attention does not go through transformers' AttentionInterface.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)  # doctest: +SKIP
        >>> use_fp32_attention(model).config._attn_implementation  # doctest: +SKIP
        'qcache_fp32'
    """
    name = register_fp32_attention()
    model.set_attn_implementation(name)
    got = model.config._attn_implementation
    if got != name:
        raise ValueError(
            f"{type(model).__name__} kept attn_implementation={got!r}: it does not dispatch attention through "
            f"transformers' AttentionInterface, so {name!r} cannot be set on it"
        )
    return model
