"""What QuantCache reads from the model that calls it, in one place.

* `positions_from_kwargs`: the `position_ids` attention passes to `Cache.update` (transformers 5.24 and later); a
  model whose attention passes none is refused by the layer that needs them (`rope="pre"`).
* `attention_module_on_stack`: the fallback that lets `QuantCache(bits=4)` work without a config, as the user's
  `generate(..., past_key_values=QuantCache(bits=4))` line is written. At layer 0 of each forward the cache looks up
  the call stack of `Cache.update` for the attention module (an `nn.Module` with `config` and this `layer_idx`) and
  binds to its config; `rotate="auto"` reads that module's q/k projections. `QuantCache(model.config, ...)` needs the
  walk only for `rotate="auto"`; without a module found, a cache built without a config raises, naming that fix.
* `tensor_parallel_ranks`: how many ranks share the KV heads (transformers' `tp_plan`).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = ["positions_from_kwargs", "attention_module_on_stack", "tensor_parallel_ranks", "check_states",
           "module_kv_heads"]


def positions_from_kwargs(kwargs: dict) -> torch.Tensor | None:
    """The `position_ids` attention handed `Cache.update`: a keyword of its own, or inside a nested `kwargs` dict."""
    inner = kwargs.get("kwargs")
    if isinstance(inner, dict) and inner.get("position_ids") is not None:
        return inner["position_ids"]
    return kwargs.get("position_ids")


def tensor_parallel_ranks() -> int:
    """Ranks of the default process group (transformers' tp_plan shards KV heads over them), else 1."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def attention_module_on_stack(layer_idx: int, depth: int = 16) -> nn.Module | None:
    """The attention module calling `Cache.update`: the nearest frame up the call stack with a local that is an
    `nn.Module` carrying a `config` and this `layer_idx` (transformers' attention modules hold both). Looked up once per
    forward (at layer 0); the layers of that forward follow from it."""
    frame = sys._getframe(2)
    without_config = False  # an attention module of this layer without `config` (BLOOM, XGLM) was on the stack
    for _ in range(depth):
        if frame is None:
            break
        for owner in frame.f_locals.values():
            if isinstance(owner, nn.Module) and getattr(owner, "layer_idx", None) == layer_idx:
                if hasattr(owner, "config"):
                    return owner
                without_config = True
        frame = frame.f_back
    return _model_on_stack(depth) if without_config else None


def _model_on_stack(depth: int) -> nn.Module | None:
    """For attention modules without a `config` (BLOOM, XGLM): the nearest module up the stack that has one (the
    decoder model), so that binding names what the model lacks (e.g. RoPE) instead of failing to bind."""
    frame = sys._getframe(3)
    for _ in range(depth):
        if frame is None:
            return None
        for owner in frame.f_locals.values():
            if isinstance(owner, nn.Module) and hasattr(getattr(owner, "config", None), "get_text_config"):
                return owner
        frame = frame.f_back
    return None


def check_states(fingerprint: dict, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                 num_layers: int, static_keys: bool, layer_heads: int | None = None) -> None:
    """Raise unless the states of `Cache.update` fit the model a cache was built for (its `model_fingerprint`).
    `layer_heads`: the kv heads this layer computes where they are not the config's (MiMo-V2-Flash's sliding layers
    have twice `num_key_value_heads`): what the layer already holds, or what its attention module says."""
    fp = fingerprint
    head_dim, v_head_dim = fp["head_dim"], fp.get("v_head_dim", fp["head_dim"])
    if key_states.shape[-1] != value_states.shape[-1] and (key_states.shape[-1], value_states.shape[-1]) != (
            head_dim, v_head_dim):
        raise ValueError(
            f"layer {layer_idx} hands the cache keys with head_dim {key_states.shape[-1]} and values with head_dim "
            f"{value_states.shape[-1]}, but {fp['model_type']}'s config says keys {head_dim} and values {v_head_dim}: "
            "its layers cache something other than keys and values here (multi-head latent attention caches its "
            "latent and rotary part: DeepSeek-V3, MiniCPM3), which QuantCache does not support; supported are keys "
            "and values of the config's head_dim and v_head_dim")
    if layer_idx >= num_layers:
        raise ValueError(f"layer_idx={layer_idx} but the model this QuantCache was built for has {num_layers} layers; "
                         "use a new QuantCache per model")
    heads = layer_heads or fp["num_key_value_heads"]
    if key_states.dim() == 4 and key_states.shape[1] * tensor_parallel_ranks() == heads:
        heads = key_states.shape[1]  # a tensor-parallel rank holds its share of the KV heads
    if (key_states.dim() != 4 or key_states.shape[1] != heads or key_states.shape[-1] != head_dim
            or value_states.shape[-1] != v_head_dim):
        widths = f"head_dim {head_dim}" + (f", values {v_head_dim}" if v_head_dim != head_dim else "")
        raise ValueError(
            f"key_states of shape {tuple(key_states.shape)} and value_states of shape {tuple(value_states.shape)} at "
            f"layer {layer_idx}, but this QuantCache was built for [batch, {heads} kv heads, tokens, {widths}] "
            f"({fp['model_type']}); use a new QuantCache per model")
    if key_states.shape[1] != fp["num_key_value_heads"] and static_keys:
        raise ValueError(
            f"static_keys=True holds calibrated key ranges for all {fp['num_key_value_heads']} kv heads, but this "
            f"layer computes {key_states.shape[1]} of them (tensor parallelism, or a layer type with its own kv "
            "heads); allowed here: static_keys=False")


def module_kv_heads(module: nn.Module | None) -> int | None:
    """The kv heads an attention module computes, from transformers' `num_key_value_groups` (query heads per kv
    head) and its config's `num_attention_heads`; None where the module does not say."""
    groups = getattr(module, "num_key_value_groups", None)
    config = getattr(module, "config", None)
    query_heads = getattr(config, "num_attention_heads", None) if config is not None else None
    if not isinstance(groups, int) or not isinstance(query_heads, int) or groups <= 0 or query_heads % groups:
        return None
    return query_heads // groups
