"""RoPE undo/redo with the model's own rotary-embedding code.

The model's `*RotaryEmbedding` module (found in its transformers modeling file) computes cos/sin for any static
`rope_type` its config can name (default, linear, yarn, llama3, ...) and for per-layer-type RoPE (Gemma 3:
`rope_parameters` keyed by layer type). We only add the rotation itself, in fp32:

    redo:  x * cos + rotate_half(x) * sin                     (what attention applied)
    undo:  (x * cos - rotate_half(x) * sin) / (cos^2 + sin^2)  (the exact inverse; cos^2 + sin^2 is the squared
                                                                attention scaling of yarn/longrope, 1 otherwise)

Undo runs when tokens are quantized, on the cos/sin the model computes for their positions. Redo runs on every
read of the quantized region, so no cos/sin table of every position is kept (at 32k tokens and head_dim 256 such a
table is 64 MB, more than a 4-bit cache of the keys it rotates). Instead a read composes the rotation of a token at
position p = P + r from two small factors, by the angle-addition formulas:

    cos(p t) = cos(P t) cos(r t) - sin(P t) sin(r t)          P: the first position of a block of F tokens
    sin(p t) = sin(P t) cos(r t) + cos(P t) sin(r t)          r: the offset in the block, 0 <= r < F

`factors` returns the model's cos/sin at the block starts of each row ([B, n/F, R/2], computed per read) and at the
offsets 0..F-1 ([F, R/2], computed once per layer type and kept: a few KB), and `compose` multiplies them out. The
composed rotation equals the model's own up to fp32 rounding of the angle (the model's own fp32 angle p * t is
rounded to within 2^-24 of p t, about 5e-4 rad at p = 8192 for the fastest frequency; the composition is as close).

RoPE types whose frequencies depend on the sequence length ("dynamic", "longrope") rotate a token differently
depending on how long the sequence was when attention rotated it; such models are refused (rope='post' stores
their keys as attention produced them). Partial rotary (cos narrower than head_dim) rotates the leading dims and
passes the rest through; a rotary module that hands one cos/sin per rotated pair (gpt-oss: width head_dim/2, channel
i paired with i + head_dim/2) is the rotate-half layout with its halves written once, and is widened to it.

Interleaved pairs (Cohere, GLM, Helium, ERNIE: channel 2i rotates with 2i + 1) are the rotate-half layout with the
rotary channels in another order. Such a layer keeps its keys in pair order (`to_pairs`: even rotary channels, then
odd ones, then the channels RoPE leaves alone) and gives them back in the model's order (`from_pairs`); its cos/sin
are the same one-per-pair table written as rotate-half halves, wherever the module's raw cos/sin hold it:

    layout        pair i                      raw cos the rotary module returns     table t_i
    "half"        channels i, i + R/2         [t, t] (or t alone: gpt-oss)          cos[i]
    "interleaved" channels 2i, 2i + 1         [t, t] (GLM: apply_rotary_pos_emb     cos[i]
                                              re-interleaves it) or t repeated
                                              pairwise (Cohere)                     cos[2i]

At construction each layout is tried against the modeling file's own `apply_rotary_pos_emb`; a model whose rotation
matches neither, or whose layout cannot be checked, raises instead of being stored wrongly.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys

import torch
from torch import nn

from ._compat import binding_context

__all__ = ["RopeHelper", "rotate_half", "apply_rope", "undo_rope", "rotate_half_width", "compose", "find_rotary_class",
           "has_rope", "pair_order", "SEQ_DEPENDENT_ROPE", "LAYOUTS"]

logger = logging.getLogger(__name__)

# rope types whose frequencies depend on the sequence length: refused for pre-RoPE keys
SEQ_DEPENDENT_ROPE = ("dynamic", "longrope")
# how RoPE pairs channels, with where the one-per-pair table sits in the raw cos/sin: tried in this order
LAYOUTS = (("half", "halves"), ("interleaved", "halves"), ("interleaved", "pairs"))


def pair_order(head_dim: int, rot_dim: int) -> torch.Tensor:
    """[head_dim] channel order that turns interleaved pairs (2i, 2i + 1) of the first `rot_dim` channels into
    rotate-half pairs (i, i + rot_dim/2): the even rotary channels, the odd ones, then the rest in place."""
    return torch.cat([torch.arange(0, rot_dim, 2), torch.arange(1, rot_dim, 2), torch.arange(rot_dim, head_dim)])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [..., d]: (x1, x2) -> (-x2, x1) on the two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, T, R] (R <= D, leading dims rotated), as attention does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, R]
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Exact inverse of `apply_rope` (including an attention scaling folded into cos/sin)."""
    norm = cos * cos + sin * sin  # [B, T, R]: s^2 for a scaled rotation
    return apply_rope(x, cos / norm, -sin / norm)


def rotate_half_width(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, n, D] by half-width cos/sin [B or 1, n, R/2] (channel i pairs with i + R/2, R <= D; the
    dims past R pass through), as attention's x * cos + rotate_half(x) * sin, one half at a time (no rotate_half temporary)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, n, R/2]
    h = cos.shape[-1]
    x1, x2 = x[..., :h], x[..., h:2 * h]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * h < x.shape[-1]:
        parts.append(x[..., 2 * h:])
    return torch.cat(parts, dim=-1)


def compose(factors: tuple[torch.Tensor, ...], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-width cos/sin [B, n, R/2] of positions P_j + r (see the module docstring) from `RopeHelper.factors`:
    block-start cos/sin [B, nb, R/2] and offset cos/sin [F, R/2] (unit scale), for the first n positions."""
    block_cos, block_sin, off_cos, off_sin = factors
    B, nb, h = block_cos.shape
    # [B, nb, 1, R/2] x [F, R/2] -> [B, nb, F, R/2] -> [B, nb*F, R/2]
    c = block_cos.unsqueeze(2) * off_cos - block_sin.unsqueeze(2) * off_sin
    s = block_sin.unsqueeze(2) * off_cos + block_cos.unsqueeze(2) * off_sin
    F = off_cos.shape[0]
    return c.reshape(B, nb * F, h)[:, :n], s.reshape(B, nb * F, h)[:, :n]


def has_rope(text_config) -> bool:
    return getattr(text_config, "rope_parameters", None) is not None


def _modeling_module_for(text_config):
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(text_config.model_type)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def find_rotary_class(module, prefix: str | None = None) -> type[nn.Module] | None:
    """The `<Prefix>RotaryEmbedding` class of a modeling module (or its only text rotary class)."""
    if prefix and isinstance(getattr(module, f"{prefix}RotaryEmbedding", None), type):
        return getattr(module, f"{prefix}RotaryEmbedding")
    found = [
        obj for name, obj in vars(module).items()
        if name.endswith("RotaryEmbedding") and isinstance(obj, type) and issubclass(obj, nn.Module)
        and "vision" not in name.lower() and "audio" not in name.lower()
    ]
    return found[0] if len(found) == 1 else None


class RopeHelper:
    """cos/sin of a model's RoPE at arbitrary per-row positions, per layer type.

    Args:
        text_config: the decoder config (`config.get_text_config(decoder=True)`).
        modeling_module: the transformers modeling module of the model (found from the config when omitted).
        prefix: class-name prefix (e.g. "Llama") used to pick `<prefix>RotaryEmbedding`.

    Example:
        >>> rope = RopeHelper(model.config.get_text_config(decoder=True))   # doctest: +SKIP
        >>> cos, sin = rope.cos_sin(position_ids, layer_idx=0)              # doctest: +SKIP
    """

    def __init__(self, text_config, modeling_module=None, prefix: str | None = None):
        if not has_rope(text_config):
            raise ValueError(
                f"model_type={text_config.model_type!r} has no RoPE parameters (config.rope_parameters is None), so "
                "keys cannot be stored pre-RoPE; allowed: rope='post' for such models"
            )
        if modeling_module is None:
            modeling_module = _modeling_module_for(text_config)
            if prefix is None:
                from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

                cls_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text_config.model_type, "")
                prefix = cls_name.split("For")[0] or None
        rotary_cls = find_rotary_class(modeling_module, prefix)
        if rotary_cls is None:
            raise ValueError(
                f"no rotary-embedding class found for model_type={text_config.model_type!r} in "
                f"{modeling_module.__name__}; pre-RoPE keys are not supported for it (allowed: rope='post')"
            )
        self.config = text_config
        self.head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        self.rotary = rotary_cls(config=text_config)  # fp32 buffers on CPU; moved on demand
        self.takes_layer_type = "layer_type" in inspect.signature(self.rotary.forward).parameters
        layer_types = getattr(text_config, "layer_types", None)
        self.layer_types = list(layer_types) if layer_types is not None else None
        rope_params = text_config.rope_parameters
        if self.takes_layer_type:
            self.rope_types = {t: (rope_params.get(t) or {}).get("rope_type", "default") for t in set(layer_types)}
        else:
            self.rope_types = {None: rope_params.get("rope_type", "default")}
        dependent = sorted({t for t in self.rope_types.values() if t in SEQ_DEPENDENT_ROPE})
        if dependent:
            raise ValueError(
                f"model_type={text_config.model_type!r} uses rope_type {dependent[0]!r}, whose frequencies change with "
                "the sequence length: a key is rotated differently depending on when attention saw it, so it cannot "
                f"be stored pre-RoPE; not supported: {list(SEQ_DEPENDENT_ROPE)}; allowed for such models: rope='post'"
            )
        self._offsets: dict = {}  # (layer_type, F, device) -> (cos, sin) [F, R/2] at offsets 0..F-1, unit scale
        self._factors: dict = {}  # layer_type -> (its last `factors` call's key, the factors it returned)
        # per layer type, decided at its first cos/sin: the module hands one cos/sin per rotated pair (width
        # head_dim/2 with every channel rotated)
        self._widen: dict = {}
        self.layout, self._table = LAYOUTS[0]  # decided by `_check_layout`
        self._order: dict = {}  # device -> (to pairs, back) channel indices, interleaved layout only
        self._check_layout(modeling_module)

    # -- cos/sin ---------------------------------------------------------------------------------------------
    def _layer_type(self, layer_idx: int):
        if not self.takes_layer_type:
            return None
        return self.layer_types[layer_idx]

    def _compute(self, position_ids: torch.Tensor, layer_type, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [B, T, R] of the model's rotary module in the rotate-half layout [t, t] of the channels in pair
        order (the module docstring's table; a module handing t alone, as gpt-oss does, is widened), or as the module
        returns them with `raw` (what the modeling file's own function takes)."""
        device = position_ids.device
        if next(iter(self.rotary.buffers())).device != device:
            self.rotary.to(device)
        dummy = torch.empty(0, device=device, dtype=torch.float32)
        args = (dummy, position_ids) + ((layer_type,) if self.takes_layer_type else ())
        with torch.no_grad():
            cos, sin = self.rotary(*args)
        cos, sin = cos.float(), sin.float()
        if raw:
            return cos, sin
        if self._table == "pairs":  # one entry per pair, repeated pairwise: the table is every other entry
            cos, sin = cos[..., 0::2], sin[..., 0::2]
        elif self.layout == "interleaved":  # [t, t]: the table is the first half
            cos, sin = cos[..., :cos.shape[-1] // 2], sin[..., :sin.shape[-1] // 2]
        widen = self._widen.get(layer_type)
        if widen is None:
            widen = self._widen[layer_type] = (self.layout == "interleaved" or 2 * cos.shape[-1] == self.head_dim
                                               and not self._partial_rotary(layer_type))
        if widen:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return cos, sin

    def cos_sin(self, position_ids: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [B, T, R] the model computes for integer positions [B, T] (negative positions, i.e.
        padding, are treated as 0)."""
        return self._compute(position_ids.clamp(min=0).long(), self._layer_type(layer_idx))

    def factors(self, first: torch.Tensor, n: int, layer_idx: int, block: int) -> tuple[torch.Tensor, ...]:
        """What `compose` needs for positions first[b] + 0..n-1 of every row b: half-width cos/sin at the block
        starts first + block * j ([B, ceil(n / block), R/2], the model's own values) and at the offsets
        0..block-1 ([block, R/2], unit scale)."""
        layer_type = self._layer_type(layer_idx)
        nb = -(-n // block)
        # every layer of a type asks for the same positions at a decode step: the last answer per type is kept
        key = (block, nb, first.device, tuple(first.tolist()))
        found = self._factors.get(layer_type)
        if found is not None and found[0] == key:
            return found[1]
        starts = first.long()[:, None] + block * torch.arange(nb, device=first.device)  # [B, nb]
        cos, sin = self._compute(starts, layer_type)  # [B, nb, R]
        h = cos.shape[-1] // 2
        off_cos, off_sin = self._offset_table(layer_type, block, first.device)
        out = (cos[..., :h], sin[..., :h], off_cos, off_sin)
        self._factors[layer_type] = (key, out)
        return out

    def _offset_table(self, layer_type, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (layer_type, block, torch.device(device))
        table = self._offsets.get(key)
        if table is None:
            cos, sin = self._compute(torch.arange(block, device=device)[None], layer_type)  # [1, F, R]
            h = cos.shape[-1] // 2
            scale = cos[0, :1, :h]  # offset 0: cos = the attention scaling, sin = 0
            table = ((cos[0, :, :h] / scale).contiguous(), (sin[0, :, :h] / scale).contiguous())
            self._offsets[key] = table
        return table

    def nbytes(self) -> int:
        """Bytes of the tensors this helper keeps (the rotary module's buffers and the offset tables)."""
        tensors = {t.data_ptr(): t for t in self.rotary.buffers()}
        tensors.update({t.data_ptr(): t for pair in self._offsets.values() for t in pair})
        tensors.update({t.data_ptr(): t for _, factors in self._factors.values() for t in factors})
        return sum(t.untyped_storage().nbytes() for t in tensors.values())

    # -- channel order -------------------------------------------------------------------------------------------
    def _orders(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        found = self._order.get(device)
        if found is None:
            cos, _ = self._compute(torch.zeros(1, 1, dtype=torch.long), self._layer_type(0))
            order = pair_order(self.head_dim, cos.shape[-1]).to(device)
            found = self._order[device] = (order, torch.argsort(order))
        return found

    def to_pairs(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] in the model's channel order -> the order the cache keeps keys in (rotate-half pairs; x itself
        for the rotate-half layout)."""
        if self.layout == "half":
            return x
        return x.index_select(-1, self._orders(x.device)[0])

    def from_pairs(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `to_pairs`."""
        if self.layout == "half":
            return x
        return x.index_select(-1, self._orders(x.device)[1])

    # -- rotation --------------------------------------------------------------------------------------------
    def redo(self, x: torch.Tensor, position_ids: torch.Tensor, layer_idx: int) -> torch.Tensor:
        cos, sin = self.cos_sin(position_ids, layer_idx)
        return apply_rope(x.float(), cos, sin)

    def undo(self, x: torch.Tensor, position_ids: torch.Tensor, layer_idx: int) -> torch.Tensor:
        cos, sin = self.cos_sin(position_ids, layer_idx)
        return undo_rope(x.float(), cos, sin)

    def _partial_rotary(self, layer_type) -> bool:
        """Whether the config rotates only part of each head (partial_rotary_factor < 1) for this layer type."""
        params = self.config.rope_parameters
        if layer_type is not None:
            params = params.get(layer_type) or {}
        factor = params.get("partial_rotary_factor", getattr(self.config, "partial_rotary_factor", None))
        return factor is not None and factor < 1

    def _check_layout(self, modeling_module) -> None:
        """Our rotation must equal the modeling file's `apply_rotary_pos_emb`, checked by calling it as attention does
        (`ref(q, k, cos, sin)` -> `(q_rot, k_rot)`), however it is wrapped (a plain function, `functools.wraps`, or
        the `nn.Module` that the `kernels` package puts around it). A modeling file without one, or whose function
        cannot be called that way, cannot be checked and is refused."""
        ref = getattr(modeling_module, "apply_rotary_pos_emb", None)
        if not callable(ref):
            raise ValueError(
                f"model_type={self.config.model_type!r} ({binding_context()}): "
                f"{modeling_module.__name__} has no apply_rotary_pos_emb to check qcache's RoPE layout against "
                f"(found {type(ref).__name__}), so pre-RoPE keys could be stored wrongly; allowed for it: rope='post'"
            )
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, 2, 5, self.head_dim, generator=gen)
        pos = torch.arange(3, 8).unsqueeze(0)
        expected = {}
        for layout in LAYOUTS:  # the first layout that matches every layer type's reference rotation
            self.layout, self._table = layout
            self._widen.clear()
            self._order.clear()
            if all(self._matches(ref, modeling_module.__name__, x, pos, layer_type, expected)
                   for layer_type in self.rope_types):
                break
        else:
            self.layout, self._table = LAYOUTS[0]
            raise ValueError(
                f"model_type={self.config.model_type!r} rotates keys with a layout qcache does not undo (supported: "
                f"{sorted({name for name, _ in LAYOUTS})} channel pairs); allowed for it: rope='post'"
            )
        for layer_type in self.rope_types:
            idx = 0 if layer_type is None else self.layer_types.index(layer_type)
            cos, sin = self.cos_sin(pos, idx)
            h = cos.shape[-1] // 2
            first = pos[:, 0]
            c, s = compose(self.factors(first, pos.shape[1], idx, block=2), pos.shape[1])
            if not torch.allclose(c, cos[..., :h], rtol=1e-5, atol=1e-5) or not torch.allclose(
                    s, sin[..., :h], rtol=1e-5, atol=1e-5) or not torch.equal(cos[..., :h], cos[..., h:]):
                raise ValueError(
                    f"model_type={self.config.model_type!r}: its cos/sin are not a rotation by position x frequency "
                    "with paired halves, which qcache re-applies by angle addition; allowed for it: rope='post'"
                )
        self._offsets.clear()

    def _matches(self, ref, module_name: str, x: torch.Tensor, pos: torch.Tensor, layer_type, expected: dict) -> bool:
        """Whether rotating `x` in pair order with this helper's cos/sin, then restoring the model's order, gives what
        the modeling file's `ref` gives (its output kept in `expected` per layer type)."""
        idx = 0 if layer_type is None else self.layer_types.index(layer_type)
        cos, sin = self.cos_sin(pos, idx)
        # partial rotary: modeling files that rotate only the leading channels are handed only those
        sample = x[..., :cos.shape[-1]] if self._partial_rotary(layer_type) else x
        if layer_type not in expected:
            raw = self._compute(pos, layer_type, raw=True)  # as the model's attention hands them over
            expected[layer_type] = _call_reference(ref, sample, *raw, self.config.model_type, module_name)
        if self.layout == "half":
            got = apply_rope(sample, cos, sin)
        else:
            order = pair_order(sample.shape[-1], cos.shape[-1])
            got = apply_rope(sample[..., order], cos, sin)[..., torch.argsort(order)]
        return all(torch.allclose(got, e, rtol=1e-5, atol=1e-5) for e in expected[layer_type])


def _call_reference(ref, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, model_type: str,
                    module_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`ref(x, x, cos, sin)` as attention calls the modeling file's rotary function: both outputs, checked to be
    two tensors shaped like x; anything else (a call that raises, another return) refuses the model by name."""
    try:
        out = ref(x, x.clone(), cos, sin)
    except Exception as err:  # any failure of the call means the layout cannot be verified
        raise ValueError(
            f"model_type={model_type!r} ({binding_context()}): {module_name}.apply_rotary_pos_emb "
            f"cannot be called as apply_rotary_pos_emb(q, k, cos, sin) to check qcache's RoPE layout against "
            f"({type(err).__name__}: {err}), so pre-RoPE keys could be stored wrongly; allowed for it: rope='post'"
        ) from err
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(t, torch.Tensor) and t.shape == x.shape for t in out)):
        found = type(out).__name__ if not isinstance(out, (tuple, list)) else \
            f"{type(out).__name__} of {[getattr(t, 'shape', type(t).__name__) for t in out]}"
        raise ValueError(
            f"model_type={model_type!r} ({binding_context()}): {module_name}.apply_rotary_pos_emb"
            f"(q, k, cos, sin) returned {found}, expected (q_rot, k_rot) shaped {tuple(x.shape)}, so qcache's RoPE "
            "layout cannot be checked; allowed for it: rope='post'"
        )
    return out[0], out[1]


def modeling_module_of(module: nn.Module):
    """The python module that defines `module`'s class (its transformers modeling file)."""
    return sys.modules[type(module).__module__]
