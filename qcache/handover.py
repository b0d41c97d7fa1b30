"""The fused decode handover: what a quantized layer returns from `update()` when attention can read its codes.

At a decode step (one new token) a `BlockLayer` whose kernel is "compiled" does not dequantize its cache. It returns
a pair of `HeldStates`: tensors of the full shape attention expects ([B, H, T_held, D], the cache dtype) that hold
no elements of their own. Both point at one `DecodeStep`, the explicit handover: the layer, and the full-precision
tokens [sinks | residual] it holds (with qcache's C kernel and an 8-bit window: the sinks, and the window as its
codes, which the kernel reads as they are, so no dequantized copy of the window is built at a decode step).

What attention does with them decides the cost, never the result:
- `torch.nn.functional.scaled_dot_product_attention` with one query token per head (stock "sdpa" attention; GQA
  either as `enable_gqa=True` or with the query heads of a kv head packed into rows, as transformers' sdpa does
  when a mask is given), no dropout, no causal flag, and a mask shared by the heads: the layer attends from its
  codes in fp32 (`BlockLayer.decode_attention`) and the output is cast to the query's dtype.
- qcache's own fp32 attention ("qcache_fp32") calls `DecodeStep.attend` for the same case.
- states kept past the step (a test or a hook holding them while the layer takes more tokens) are settled by the
  layer before it changes: read as they were, so they never show a later state.
- any other torch operation on them (eager attention's `matmul`, `repeat_kv`, a flash kernel's transpose, a print):
  the layer's keys and values are read once (`BlockLayer.read`, as `update()` returns them otherwise) and the
  operation runs on those. So a model or attention function that does anything else gets exactly what a plain
  `update()` would have given it.

This is the tensor-subclass pattern torchao uses for quantized weights in `F.linear`: the object that reaches the
operation carries what it needs to run it differently. docs/design.md argues the choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

__all__ = ["DecodeStep", "HeldStates"]

# reading these needs no elements: answered from the wrapper's own metadata
_METADATA = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__, torch.Tensor.ndim.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.element_size, torch.Tensor.__len__, torch.Tensor.numel, torch.Tensor.layout.__get__,
    torch.Tensor.is_floating_point, torch.Tensor.get_device,
}


class DecodeStep:
    """One decode step of one layer, handed from `update()` to attention.

    Args:
        layer: the `BlockLayer` holding the codes (it attends with `decode_attention`, reads with `read`).
        fp_k / fp_v: the full-precision tokens attention reads besides the codes, in the cache dtype: [sinks |
            residual] [B, H, S + R, D]; or, with `window`, the sinks [B, H, S, D] alone.
        held: tokens the layer holds (sinks + quantized + residual).
        window: the 8-bit residual window as the layer's kernel reads it from its codes (`native.Window`), or None.
    """

    def __init__(self, layer, fp_k: torch.Tensor, fp_v: torch.Tensor, held: int, window=None):
        self.layer, self.held, self.window = layer, held, window
        self._fp = (fp_k, fp_v)
        self._full = None if window is not None else self._fp
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None
        self.live = True  # False once the layer changed: then only the keys/values read before that remain
        self.fused = 0  # attention calls served from the codes (for tests and benchmarks)

    @property
    def fp_k(self) -> torch.Tensor:
        """[sinks | residual] keys [B, H, S + R, D] in the cache dtype (with a `window`: read from the layer on first
        use, dequantized as `read()` gives them)."""
        return self.full_precision()[0]

    @property
    def fp_v(self) -> torch.Tensor:
        return self.full_precision()[1]

    def full_precision(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._full is None:
            if not self.live:
                raise RuntimeError(f"layer {self.layer.layer_idx}: this decode step's window was asked for after the "
                                   "layer took more tokens; use dense()")
            res_k, res_v = self.layer._window()
            self._full = tuple(torch.cat([fp, res], dim=2) for fp, res in zip(self._fp, (res_k, res_v)))
        return self._full

    def settle(self) -> None:
        """Called by the layer before it changes (a new update, a crop, a batch operation, a reset) while this step
        is still referenced: keep this step's keys and values as they are now."""
        self.dense()
        self.live = False

    def states(self) -> tuple["HeldStates", "HeldStates"]:
        """The keys and values to return from `update()`."""
        return HeldStates(self, 0), HeldStates(self, 1)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values as `update()` returns them without a handover (read once per step)."""
        if self._dense is None:
            self._dense = self.layer.read()
        return self._dense

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
        """fp32 attention of `query` [B, H, G, D] (the G query rows of kv head h) over every token held, from the
        codes; mask: None, bool (True = attend) or additive, [B or 1, 1, 1, T_held]. Returns [B, H, G, D] fp32."""
        if not self.live:
            raise RuntimeError(f"layer {self.layer.layer_idx}: this decode step's states were attended after the layer "
                               "took more tokens; use dense()")
        self.fused += 1
        return self.layer.decode_attention(query, mask, scaling, self._fp, self.window)


class HeldStates(torch.Tensor):
    """Keys (`index` 0) or values (1) of a `DecodeStep`: shaped [B, H, T_held, D] in the cache dtype, with no
    elements of its own (see the module docstring for what operations on it do)."""

    step: DecodeStep
    index: int

    @staticmethod
    def __new__(cls, step: DecodeStep, index: int):
        like = step._fp[index]  # (the sinks with a window: shape and dtype only)
        B, H, _, D = like.shape
        out = torch.Tensor._make_wrapper_subclass(cls, (B, H, step.held, D), dtype=like.dtype, device=like.device)
        out.step, out.index = step, index
        return out

    def dense(self) -> torch.Tensor:
        """This tensor's elements, read from the layer."""
        return self.step.dense()[self.index]

    def __repr__(self) -> str:
        return f"HeldStates({'keys' if self.index == 0 else 'values'}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _attend_from_codes(*args, **kwargs)
            if out is not None:
                return out
        elif func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(_dense, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached only below the Python-level override (e.g. with torch functions disabled): read, then run
        args, kwargs = tree_map(_dense, (args, kwargs or {}))
        return func(*args, **kwargs)


def _dense(x):
    return x.dense() if isinstance(x, HeldStates) else x


def _attend_from_codes(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    """`F.scaled_dot_product_attention` from the codes where the call is one decode step of a `DecodeStep`'s keys
    and values; None where it is anything else (the caller then reads the layer and runs the real function)."""
    if not (isinstance(key, HeldStates) and isinstance(value, HeldStates) and key.step is value.step
            and key.index == 0 and value.index == 1 and key.step.live) or isinstance(query, HeldStates):
        return None
    if dropout_p or is_causal or query.dim() != 4:
        return None
    B, Hq, rows, D = query.shape
    H, T = key.shape[1], key.shape[2]
    if Hq == H:  # one row per query of kv head h: transformers' pack_gqa, or one query head per kv head
        q = query
    elif enable_gqa and rows == 1 and Hq % H == 0:  # query head h*G+g reads kv head h, as repeat_kv
        q = query.reshape(B, H, Hq // H, D)
    else:
        return None
    if attn_mask is not None and (attn_mask.dim() != 4 or attn_mask.shape[1:3] != (1, 1) or attn_mask.shape[-1] != T
                                  or attn_mask.shape[0] not in (1, B)):
        return None
    out = key.step.attend(q.float(), attn_mask, scale)  # [B, H, G, D] fp32
    return out.reshape(query.shape).to(query.dtype)
