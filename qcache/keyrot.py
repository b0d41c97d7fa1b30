"""Whether a layer's keys are rotated (`rotate="auto"`, the default): decided per layer from the model's weights.

Keys are quantized per channel (one range per channel per block of tokens), so the error a channel takes grows with
that channel's spread. A score is q . k, and its error q . dk weighs the error of channel c by the query energy in c.
Unrotated, the error follows the key spread channel by channel; after a Hadamard rotation R (stored as k R, read back
as (k R) Rᵀ) each rotated channel holds a mix of all channels of its block, and the error read back is spread evenly
over them. With w the query energy and s the key energy per channel (diagonal, Gaussian-like keys), and P = R ∘ R
(the squared entries of R):

    score error, unrotated ∝ Σ_c w_c s_c              score error, rotated ∝ Σ_c w_c (P Pᵀ s)_c

For one block spanning the head (a power-of-two head dim) the ratio is mean(w) mean(s) / mean(w s): rotation wins
unless the queries put their energy where the keys are small. That happens: Gemma-3-270M's global layers have a ratio
of 2-14, SmolLM2-135M's layers 0.75-0.98. The energies come from the weights: the squared row norms of `q_proj` and
`k_proj` per head and channel (hidden states taken as isotropic), rescaled by the gain of `q_norm` / `k_norm` where the
attention normalizes its heads; a channel and its RoPE partner (rotate-half pairs) share their mean, since RoPE turns
energy between them; query heads of a key/value group are averaged. Keys are rotated where the ratio is below 1.

`bench/key_rotation.py` checks the rule against the same ratio measured with real queries and keys on real text
(`docs/results/key-rotation.md`).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

__all__ = ["key_rotation_ratio", "layer_ratio", "pair_mean", "projection_energy", "rotary_width", "weight_energies"]


def pair_mean(e: torch.Tensor, rot_dim: int) -> torch.Tensor:
    """[..., D] -> each channel of the rotary part replaced by the mean of it and its rotate-half partner."""
    half = rot_dim // 2
    paired = (e[..., :half] + e[..., half:rot_dim]) / 2
    return torch.cat([paired, paired, e[..., rot_dim:]], dim=-1)


def rotary_width(text_config, rope=None, layer_idx: int = 0) -> int:
    """Channels of a head that RoPE rotates: the width of the model's own cos table when a `RopeHelper` is at hand,
    else head_dim times the config's `partial_rotary_factor` (1 when it has none)."""
    if rope is not None:
        cos, _ = rope.cos_sin(torch.zeros(1, 1, dtype=torch.long), layer_idx)
        return cos.shape[-1]
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return int(head_dim * float(getattr(text_config, "partial_rotary_factor", None) or 1.0)) // 2 * 2


def projection_energy(proj: nn.Module, norm: nn.Module | None, heads: int, head_dim: int, what: str
                      ) -> torch.Tensor:
    """[heads, head_dim] energy per channel of a projection's output (`q_proj` or `k_proj`): squared row norms of its
    weight, and, where the attention normalizes each head (`q_norm` / `k_norm`), the relative energy within the head
    times the squared gain of that norm (its output for a vector of ones: the convention of its weight, 1 + w or w,
    is the module's own)."""
    weight = getattr(proj, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_meta:
        raise ValueError(f"rotate='auto' reads the {what} weight, and it is not in memory (offloaded: a meta tensor); "
                         "allowed here: rotate='v' or rotate='kv'")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != heads * head_dim \
            or not weight.is_floating_point():
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        raise ValueError(f"rotate='auto' reads the {what} weight as a dense [{heads} heads x {head_dim}, hidden] "
                         f"float matrix; this model's is {shape} "
                         f"({type(weight).__name__ if weight is not None else 'missing'}); allowed here: rotate='v' "
                         "or rotate='kv'")
    energy = weight.detach().float().pow(2).sum(1).view(heads, head_dim)
    if norm is not None:
        norm_weight = getattr(norm, "weight", None)
        if isinstance(norm_weight, torch.Tensor) and norm_weight.numel() != head_dim:
            raise ValueError(f"rotate='auto' reads a per-head {what} norm, and this one spans {norm_weight.numel()} "
                             f"channels (all heads at once), not a head's {head_dim}; allowed here: rotate='v' or "
                             "rotate='kv'")
        ones = torch.ones(head_dim, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            try:
                gain = norm(ones).detach().float().reshape(-1)
            except RuntimeError as err:
                raise ValueError(f"rotate='auto' could not read the gain of the {what} head norm ({err}); allowed "
                                 "here: rotate='v' or rotate='kv'") from err
        if gain.numel() != head_dim:
            raise ValueError(f"rotate='auto': the {what} head norm returns {gain.numel()} channels for a head of "
                             f"{head_dim}; allowed here: rotate='v' or rotate='kv'")
        energy = energy / energy.mean(-1, keepdim=True).clamp(min=1e-30) * gain.pow(2)
    return energy


def weight_energies(module: nn.Module, heads: int, kv_heads: int, head_dim: int, rot_dim: int, order=None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(query energy, key energy), each [kv_heads, head_dim], of an attention module with `q_proj` and `k_proj`
    (and optional `q_norm` / `k_norm`): query heads averaged over each key/value group, RoPE pairs averaged
    (`order`: puts the channels of a [..., D] tensor in rotate-half pair order, `RopeHelper.to_pairs`)."""
    missing = [name for name in ("q_proj", "k_proj") if not isinstance(getattr(module, name, None), nn.Module)]
    if missing:
        raise ValueError(f"rotate='auto' decides from the attention's q_proj and k_proj weights; "
                         f"{type(module).__name__} has no {' or '.join(missing)} (fused projections?); allowed here: "
                         "rotate='v' (keys unrotated) or rotate='kv' (keys rotated)")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split into {kv_heads} key/value groups")
    # every fresh cache asks again (a new cache per request): the answer is kept per module while its weights are
    # the same tensors, unmodified (a parameter's _version moves on every in-place write)
    tensors = [t for name in ("q_proj", "k_proj", "q_norm", "k_norm")
               for t in (getattr(getattr(module, name, None), "weight", None),) if isinstance(t, torch.Tensor)]
    key = (heads, kv_heads, head_dim, rot_dim, order is not None,
           tuple((t.data_ptr(), t._version, t.dtype, t.shape) for t in tensors))
    held = _ENERGIES.get(module)
    if held is not None and held[0] == key:
        return held[1]
    q = projection_energy(module.q_proj, getattr(module, "q_norm", None), heads, head_dim, "q_proj")
    k = projection_energy(module.k_proj, getattr(module, "k_norm", None), kv_heads, head_dim, "k_proj")
    q = q.view(kv_heads, heads // kv_heads, head_dim).mean(1)
    if order is not None:
        q, k = order(q), order(k)
    energies = pair_mean(q, rot_dim), pair_mean(k, rot_dim)
    _ENERGIES[module] = (key, energies)
    return energies


_ENERGIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (weights key, energies)


def key_rotation_ratio(q_energy: torch.Tensor, k_energy: torch.Tensor, rotation: torch.Tensor) -> float:
    """Estimated score error of rotated over unrotated keys (below 1: rotate), summed over the key/value heads.

    q_energy, k_energy: [H, D] energy per channel; rotation: the [D, D] matrix keys are stored through (k R)."""
    p = rotation.float().to(k_energy.device).pow(2)  # [D, D]
    spread = k_energy.float() @ p @ p.T  # [H, D]: (P Pᵀ s) per head, s as a row
    unrotated = (q_energy.float() * k_energy.float()).sum()
    return float((q_energy.float() * spread).sum() / unrotated.clamp(min=1e-30))


def layer_ratio(module: nn.Module | None, text_config, num_key_value_heads: int, head_dim: int, kv_heads: int,
                rope, layer_idx: int, rotation) -> float:
    """The estimated rotated/unrotated score error of layer `layer_idx` from its attention `module`'s weights
    (`kv_heads`: this process's share of the `num_key_value_heads` under tensor parallelism; `rotation`: the cache's `SharedRotation`). Raises ValueError if
    there is no module to read or it lacks dense q_proj/k_proj weights."""
    if module is None or getattr(module, "config", None) is None:
        raise ValueError(
            f"rotate='auto' decides per layer from the attention module's q_proj/k_proj weights, and no attention "
            f"module of layer {layer_idx} was found up the call stack of Cache.update (called outside a model "
            "forward?); allowed without one: rotate='v' (keys unrotated) or rotate='kv'")
    heads = text_config.num_attention_heads * kv_heads // num_key_value_heads
    order = rope.to_pairs if rope is not None else None  # energies in the channel order the cache keeps keys in
    q_energy, k_energy = weight_energies(module, heads, kv_heads, head_dim, rotary_width(text_config, rope, layer_idx),
                                         order)
    return key_rotation_ratio(q_energy, k_energy, rotation.on(q_energy.device))
