"""Collect what calibration needs from a real model running over real text.

A recording attention function (registered through transformers' attention interface as "qcache_calibrate")
computes plain fp32 attention and keeps, per layer:

    keys      [H, N, D]  pre-RoPE keys (RoPE undone with the model's own rotary code)
    values    [H, N, D]
    k_weight  [H, D]     key sensitivity per channel: mean query energy over the rotation pair of the channel
                         (a key error dk changes a score by q . R dk; averaged over positions, channel c and its
                         RoPE partner share the weight (q_c^2 + q_partner^2) / 2)
    v_weight  [H, N]     value sensitivity per token: attention mass the token receives
    positions [N]

where N is the number of calibration tokens (all sequences concatenated).

The recording attention is registered for the duration of `collect_statistics` only: on return (or error) the
attention and mask registries hold what they held before, and the recorded chunks are released layer by layer as
they are concatenated, so the peak is the recorded data plus one layer, not twice the data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from qcache.keyrot import pair_mean, rotary_width
from qcache.rope import RopeHelper

__all__ = ["LayerStats", "collect_statistics", "ATTN_NAME"]

log = logging.getLogger(__name__)
ATTN_NAME = "qcache_calibrate"


@dataclass
class LayerStats:
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    k_weight: list = field(default_factory=list)
    v_weight: list = field(default_factory=list)

    def stacked(self) -> dict[str, torch.Tensor]:
        """The chunks joined ([H, N, D] keys and values, [H, D] k_weight, [H, N] v_weight); the chunk lists are
        emptied as each tensor is built, so a chunk lives no longer than its joined copy needs it."""
        out = {}
        for name, join in (("keys", lambda c: torch.cat(c, dim=1)), ("values", lambda c: torch.cat(c, dim=1)),
                           ("k_weight", lambda c: torch.stack(c).mean(0)), ("v_weight", lambda c: torch.cat(c, dim=1))):
            chunks = getattr(self, name)
            out[name] = join(chunks)
            chunks.clear()
        return out


class _Recorder:
    def __init__(self, rope: RopeHelper | None, rot_dim: int):
        self.rope = rope
        self.rot_dim = rot_dim
        self.layers: dict[int, LayerStats] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query: [B, Hq, T, D]; key/value: [B, Hkv, S, D] (S = T: calibration runs without a cache)
        B, Hq, T, D = query.shape
        Hkv = key.shape[1]
        groups = Hq // Hkv
        q, k, v = query.float(), key.float(), value.float()
        k_rep = k.repeat_interleave(groups, dim=1)  # [B, Hq, S, D]
        v_rep = v.repeat_interleave(groups, dim=1)
        scores = q @ k_rep.transpose(-1, -2) * (scaling if scaling is not None else D**-0.5)  # [B, Hq, T, S]
        softcap = getattr(module.config, "attn_logit_softcapping", None)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if attention_mask is not None:
            mask = attention_mask[:, :, :, : k.shape[2]]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = scores.softmax(dim=-1)  # fp32 accumulation
        out = probs @ v_rep  # [B, Hq, T, D]

        layer = self.layers.setdefault(module.layer_idx, LayerStats())
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(k.shape[2], device=k.device).expand(B, -1)
        # keys and queries in the channel order the cache keeps (RoPE pairs as rotate-half halves)
        q_pairs = self.rope.to_pairs(q) if self.rope is not None else q
        pre = self.rope.undo(self.rope.to_pairs(k), position_ids, module.layer_idx) if self.rope is not None else k
        # [B, H, S, D] -> [H, B*S, D]
        layer.keys.append(pre.transpose(0, 1).reshape(Hkv, -1, D).cpu())
        layer.values.append(v.transpose(0, 1).reshape(Hkv, -1, D).cpu())
        energy = pair_mean(q_pairs.pow(2), self.rot_dim).mean(dim=(0, 2))  # [Hq, D]: query energy per RoPE pair
        layer.k_weight.append(energy.view(Hkv, groups, D).mean(1).cpu())
        mass = probs.sum(dim=2).view(B, Hkv, groups, -1).mean(2)  # [B, Hkv, S]: attention received per key
        layer.v_weight.append(mass.transpose(0, 1).reshape(Hkv, -1).cpu())
        return out.to(query.dtype).transpose(1, 2).contiguous(), None


@contextmanager
def _registered_attention(name: str, attention: Callable, mask: Callable) -> Iterator[None]:
    """Register `attention` and its `mask` function under `name` in transformers' attention and mask interfaces
    for the duration of the block; afterwards each registry holds what it held before (an entry of that name is
    put back, a new one removed).

    The registries are class-wide dicts (`GeneralInterface._global_mapping`) with `register` but no unregister:
    restoring goes through that dict (the mask code reads it directly too)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    missing = object()
    entries = ((AttentionInterface, attention), (AttentionMaskInterface, mask))
    before = [registry._global_mapping.get(name, missing) for registry, _ in entries]
    try:
        for registry, fn in entries:
            registry.register(name, fn)
        yield
    finally:
        for (registry, _), old in zip(entries, before):
            if old is missing:
                registry._global_mapping.pop(name, None)
            else:
                registry._global_mapping[name] = old


@torch.no_grad()
def collect_statistics(model, input_ids: torch.Tensor, batch_size: int = 1, progress: bool = True
                       ) -> dict[int, dict[str, torch.Tensor]]:
    """Run `model` over `input_ids` [N, L] with the recording attention; return per-layer statistics.

    The recording attention is registered only while this runs, and the model's attention implementation is put
    back afterwards (also on error)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    text_config = model.config.get_text_config(decoder=True)
    rope = RopeHelper(text_config) if getattr(text_config, "rope_parameters", None) is not None else None
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    recorder = _Recorder(rope, rotary_width(text_config, rope) if rope is not None else head_dim)
    device = next(model.parameters()).device
    with _registered_attention(ATTN_NAME, recorder, ALL_MASK_ATTENTION_FUNCTIONS["eager"]):
        previous = model.config._attn_implementation
        model.set_attn_implementation(ATTN_NAME)
        try:
            for start in tqdm(range(0, input_ids.shape[0], batch_size), desc="calibration forward",
                              disable=not progress):
                model(input_ids[start:start + batch_size].to(device), use_cache=False)
        finally:
            model.set_attn_implementation(previous)
    recorded, recorder.layers = recorder.layers, {}
    # one layer at a time: its chunks are dropped as soon as they are joined
    return {idx: recorded.pop(idx).stacked() for idx in sorted(recorded)}
