"""RoPE undo/redo with the model's own rotary-embedding code.

The model's `*RotaryEmbedding` module (found in its transformers modeling file) computes cos/sin for any
`rope_type` its config can name (default, linear, dynamic, yarn, longrope, llama3, ...) and for per-layer-type RoPE
(Gemma 3: `rope_parameters` keyed by layer type). We only add the rotation itself, in fp32:

    redo:  x * cos + rotate_half(x) * sin                     (what attention applied)
    undo:  (x * cos - rotate_half(x) * sin) / (cos^2 + sin^2)  (the exact inverse; cos^2 + sin^2 is the squared
                                                                attention scaling of yarn/longrope, 1 otherwise)

Partial rotary (cos narrower than head_dim) rotates the leading dims and passes the rest through. At construction the
rotation is checked against the modeling file's own `apply_rotary_pos_emb`; a model with another layout (e.g.
interleaved pairs) raises instead of being stored wrongly.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys

import torch
from torch import nn

__all__ = ["RopeHelper", "rotate_half", "apply_rope", "undo_rope", "find_rotary_class", "has_rope"]

logger = logging.getLogger(__name__)

# rope types whose frequencies depend on the longest position seen: recomputed per call, never tabulated
_SEQ_DEPENDENT_ROPE = ("dynamic", "longrope")


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


def apply_rope_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """`out[...] = apply_rope(x, cos, sin)` (cast to out's dtype) without the temporaries of rotate_half: each half
    is computed once and written straight into `out` (same arithmetic, so the same values)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, R]
    r = cos.shape[-1]
    h = r // 2
    x1, x2 = x[..., :h], x[..., h:r]
    out[..., :h] = x1 * cos[..., :h] - x2 * sin[..., :h]
    out[..., h:r] = x2 * cos[..., h:] + x1 * sin[..., h:]
    if r < x.shape[-1]:
        out[..., r:] = x[..., r:]


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
        self._tables: dict = {}  # (layer_type, device) -> (cos [P, R], sin [P, R]) for positions 0..P-1
        self._check_layout(modeling_module)

    # -- cos/sin ---------------------------------------------------------------------------------------------
    def _layer_type(self, layer_idx: int):
        if not self.takes_layer_type:
            return None
        return self.layer_types[layer_idx]

    def _compute(self, position_ids: torch.Tensor, layer_type) -> tuple[torch.Tensor, torch.Tensor]:
        device = position_ids.device
        if next(iter(self.rotary.buffers())).device != device:
            self.rotary.to(device)
        dummy = torch.empty(0, device=device, dtype=torch.float32)
        args = (dummy, position_ids) + ((layer_type,) if self.takes_layer_type else ())
        with torch.no_grad():
            cos, sin = self.rotary(*args)
        return cos.float(), sin.float()

    def cos_sin(self, position_ids: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [B, T, R] for integer positions [B, T] (negative positions are treated as 0)."""
        layer_type = self._layer_type(layer_idx)
        position_ids = position_ids.clamp(min=0).long()
        if self.rope_types[layer_type] in _SEQ_DEPENDENT_ROPE:
            return self._compute(position_ids, layer_type)
        need = int(position_ids.max()) + 1 if position_ids.numel() else 1
        table = self._table(layer_type, position_ids.device, need)
        first = position_ids[:, :1]  # [B, 1]
        if bool((first == first[0]).all()) and bool(
                (position_ids == first + torch.arange(position_ids.shape[1], device=first.device)).all()):
            start = int(first[0, 0])  # every row holds the same consecutive positions: a view, no gather
            n = position_ids.shape[1]
            return table[0][start:start + n].unsqueeze(0), table[1][start:start + n].unsqueeze(0)  # [1, T, R]
        return table[0][position_ids], table[1][position_ids]  # [B, T, R]

    def _table(self, layer_type, device, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [P, R] for positions 0..P-1 (P >= need) of a table-based RoPE type, grown by doubling."""
        key = (layer_type, torch.device(device))
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < need:
            size = max(need, 2 * (table[0].shape[0] if table else 256))
            cos, sin = self._compute(torch.arange(size, device=device).unsqueeze(0), layer_type)  # [1, P, R]
            table = (cos[0], sin[0])
            self._tables[key] = table
        return table

    def cos_sin_range(self, start: int, n: int, layer_idx: int,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin [1, n, R] for positions start..start+n-1 in every row: a view of the table (no gather, no
        device sync: the decode read calls it every step) for table-based RoPE types."""
        layer_type = self._layer_type(layer_idx)
        if n == 0 or self.rope_types[layer_type] in _SEQ_DEPENDENT_ROPE:
            return self.cos_sin(torch.arange(start, start + n, device=device)[None], layer_idx)
        cos, sin = self._table(layer_type, device, start + n)
        return cos[start:start + n].unsqueeze(0), sin[start:start + n].unsqueeze(0)

    # -- rotation --------------------------------------------------------------------------------------------
    def redo(self, x: torch.Tensor, position_ids: torch.Tensor, layer_idx: int) -> torch.Tensor:
        cos, sin = self.cos_sin(position_ids, layer_idx)
        return apply_rope(x.float(), cos, sin)

    def undo(self, x: torch.Tensor, position_ids: torch.Tensor, layer_idx: int) -> torch.Tensor:
        cos, sin = self.cos_sin(position_ids, layer_idx)
        return undo_rope(x.float(), cos, sin)

    def _check_layout(self, modeling_module) -> None:
        """Our rotation must equal the modeling file's `apply_rotary_pos_emb` (when it has one)."""
        ref = getattr(modeling_module, "apply_rotary_pos_emb", None)
        if ref is None:
            return
        params = list(inspect.signature(ref).parameters)
        if params[:4] != ["q", "k", "cos", "sin"]:
            return
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1, 2, 5, self.head_dim, generator=gen)
        pos = torch.arange(3, 8).unsqueeze(0)
        for layer_type in self.rope_types:
            idx = 0 if layer_type is None else self.layer_types.index(layer_type)
            cos, sin = self.cos_sin(pos, idx)
            expected, _ = ref(x, x, cos, sin)
            got = apply_rope(x, cos, sin)
            if not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
                raise ValueError(
                    f"model_type={self.config.model_type!r} rotates keys with a layout qcache does not undo "
                    "(only the rotate-half layout is supported); allowed for it: rope='post'"
                )


def modeling_module_of(module: nn.Module):
    """The python module that defines `module`'s class (its transformers modeling file)."""
    return sys.modules[type(module).__module__]
