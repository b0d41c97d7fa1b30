"""Named settings per budget, each the best that the fidelity runner measured for its size on both test models.

    QuantCache(preset="k3v3")                 # 3-bit keys and values: ~3.5 bits/value held at 8k tokens
    QuantCache(preset="k3v2", recent_tokens=128)   # a preset, one option changed

"k4v4", "k3v3" and "k2v2" are what `QuantCache(bits=4)`, `bits=3` and `bits=2` resolve to (the defaults of
`QuantCacheConfig` were chosen by the same runs); the presets name them and the K/V splits beside them. Every preset
rotates values (`rotation="hadamard"`: head_dim must be a multiple of 8), scales each value token by
one least-squares number with Gaussian Lloyd-Max levels (`v_scale="norm"`), keeps keys per channel in blocks of 128
tokens, rotated in the layers whose weights say so (`rotate` left at its default, "auto": qcache/keyrot.py), on
uniform levels (at 2 bits on data-free Lloyd-Max levels), and holds the residual window 8-bit
(`window_bits=8`). Why these (docs/results, one document each, KL against the default cache over the second half of
the context):

- value rotation with `v_scale="norm"`: on SmolLM2-135M at 8192 tokens, 3-bit KL 0.0285 -> 0.0209 at 0.12 fewer
  bits/value (`levers2-smollm2-135m.md`, with keys rotated too); on Gemma-3-270M at 32768 tokens 0.0071 -> 0.0060
  (`levers2-gemma3-270m.md`).
- keys rotated per layer: rotating keys costs Gemma-3 five to seven times its KL (3-bit 0.0071 -> 0.035, keys
  rotated alone; 0.0049 -> 0.035 on top of these options at 8192 tokens, `ablation-gemma3-270m-table.md`); on
  SmolLM2 it helps (3-bit KL 0.0118 -> 0.0069 on uniform levels, `ablation-smollm2-135m-table.md`). The weight rule
  of `rotate="auto"` picks each side (`key-rotation.md`): every SmolLM2 layer rotated, no Gemma-3 global layer.
- 128-token key blocks and the window they leave in full precision: SmolLM2 3-bit KL 0.021 -> 0.013
  (`levers2-smollm2-135m.md`); without a recent window KL triples (`levers3-smollm2-135m.md`).
- `window_bits=8`: the same quality at 0.24 fewer bits/value at 8k tokens (3-bit 3.72 -> 3.48, KL 0.0132 ->
  0.0134: `levers2-smollm2-135m.md` vs `window-smollm2-135m.md`).
- Lloyd-Max key levels at 2 bits: KL 0.18 -> 0.068 (Δ PPL +15.3 -> +7.4 %) on SmolLM2 at 8192 and 0.035 -> 0.029
  (+3.5 -> +1.5 %) on Gemma-3 at 32768 (`ablation-smollm2-135m-4-2-table.md`, `ablation-gemma3-270m-32k-2bit-table.md`);
  at 3 and 4 bits they cost 1.05-1.4x the KL, so wider keys stay uniform.
- "k3v2" keeps 256 recent tokens: 3-bit keys with 2-bit values at KL 0.018 (3.08 bits/value) where 128 give 0.027.

What each measures: `presets-smollm2-135m.md` and `presets-gemma3-270m.md` (made at 7d9a312, with keys unrotated
on both models: the Gemma-3 one is what these presets still give, the SmolLM2 one is not: `auto-smollm2-135m.md`
measures SmolLM2's defaults with rotated keys). A limit those runs show: at 3-bit keys the needles far back in
the context are lost more often than with the default cache (SmolLM2 at 8192: 13 % found against 40 %; at 2 bits
none are kept on either model) although KL and perplexity barely move: keep needles with 4-bit keys (SmolLM2
"k4v2", its keys rotated by the default rule: 3.48 bits/value, 33 % at 8192, `needles-keys2-smollm2-135m.md`,
`k4v2kv-smollm2-135m.md`, measured as `rotate="kv"`), on uniform levels (Lloyd-Max key levels lose needles:
`needles-keys-smollm2-135m.md`). On a model with sliding layers,
holding them as tokens (`sliding_layers="tokens", sliding_bits=8, sliding_v_bits=4`) pays for those 4-bit keys:
Gemma-3 k4v2 that way holds 3.49 bits/value at 32768 tokens with its needles inside the default cache's interval at
8k, 16k and 32k (`tokens2-gemma3-270m.md`). The presets leave sliding layers native: that choice is per model.
"""

from __future__ import annotations

__all__ = ["PRESETS", "preset_options"]

_COMMON = {"rotation": "hadamard", "v_scale": "norm", "k_group_size": 128, "window_bits": 8}

PRESETS: dict[str, dict] = {
    "k4v4": {"k_bits": 4, "v_bits": 4, **_COMMON},
    "k4v3": {"k_bits": 4, "v_bits": 3, **_COMMON},
    "k3v3": {"k_bits": 3, "v_bits": 3, **_COMMON},
    "k3v2": {"k_bits": 3, "v_bits": 2, **_COMMON, "recent_tokens": 256},
    "k2v2": {"k_bits": 2, "v_bits": 2, **_COMMON, "levels": "lloyd-max"},
}


def preset_options(name: str, **overrides) -> dict:
    """The options of preset `name`, updated with `overrides` (`bits=` replaces the preset's widths)."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not a preset; allowed values: {list(PRESETS)}")
    options = dict(PRESETS[name])
    if overrides.get("bits") is not None:
        options.pop("k_bits"), options.pop("v_bits")
    return {**options, **overrides}
