"""Per-layer widths under a budget: measure how much each layer's keys and values lose at each width, then spend
bits where they buy the most.

Sensitivity of (layer l, stream s, width w): the KL divergence, nats per token, of the next-token distributions of a
cache whose every quantized layer holds 8-bit keys and values except stream s of layer l at w bits, against the
default (full-precision) cache, minus the same KL with every layer at 8 bits. The text (calibration split) goes
through both caches `chunk` tokens at a time, as the fidelity runner feeds it, and the second half of each sequence
is scored, where most of the cache is quantized. One forward pass of the sequences per (l, s, w).

Allocation (`allocate`): start every quantized (layer, stream) at the narrowest width, then repeatedly widen the one
whose next width lowers its sensitivity most, as long as the plan's bits/value (`qcache.layout.bytes_per_token`
at `context` tokens: codes, scales, full-precision tokens; not reserved capacity) stays within the budget. Widening
a stream costs the same bits in every layer (all layers hold the same number of values), so this greedy choice is
the best step per bit; it treats the losses of different layers as adding up, which holds for small losses.

Needle floors (`needle_floors`, optional): the KL of ordinary text hardly sees the few heads that retrieve a fact
from far back, and those can sit in one or two layers (SmolLM2-135M: the keys of layer 18 at 3 bits, every other
layer at 8, lose 1.9 nats of a needle answer's log-probability, layer 7's 0.42, every other layer's at most 0.10:
bench/needle_layers.py). So, before the
allocation, each (layer, stream) is measured alone, like the sensitivities, on key-value needles in a haystack of
calibration text: the drop of the needles' mean answer log-probability at 2 bits, then 3 and 4 where it is above
`threshold` nats; the narrowest width within the threshold (8 if none is) is that stream's floor, and the allocation
starts from the floors.

Example:
    >>> sens = {(0, "k", 2): 0.3, (0, "k", 3): 0.05, (0, "k", 4): 0.01, (0, "v", 2): 0.1, (0, "v", 3): 0.02,
    ...         (0, "v", 4): 0.005, (1, "k", 2): 0.02, (1, "k", 3): 0.004, (1, "k", 4): 0.001,
    ...         (1, "v", 2): 0.01, (1, "v", 3): 0.003, (1, "v", 4): 0.001}
    >>> opts = QuantCacheConfig(recent_tokens=0, sink_tokens=0)
    >>> allocate(sens, opts, budget=3.6, num_layers=2, quantized=[0, 1], kv_heads=1, head_dim=64, context=4096)
    ((4, 3), (3, 2))
"""

from __future__ import annotations

import dataclasses

import torch
from tqdm.auto import tqdm

from qcache import layout
from qcache.config import QuantCacheConfig

__all__ = ["measure_sensitivities", "choose_rotate", "KEY_CHOICES", "reference_logprobs", "allocate",
           "plan_bits_per_value", "needle_floors", "PLAN_BITS", "FLOOR_BITS"]

PLAN_BITS = (2, 3, 4)
FLOOR_BITS = PLAN_BITS + (8,)  # a needle floor may ask for 8 bits
_BASE = 8  # every other layer's width while one (layer, stream) is measured


def _kl_of(model, input_ids: torch.Tensor, make_cache, reference: list[torch.Tensor], chunk: int) -> float:
    """Mean KL(reference || cache) over the second half of each sequence, nats/token."""
    total, count = 0.0, 0
    for row, ref in zip(input_ids, reference):
        cache = make_cache()
        logps = []
        for start in range(0, row.numel(), chunk):
            out = model(row[None, start:start + chunk], cache=cache, use_cache=True)
            logps.append(out.logits[0].float().log_softmax(-1))
        logp = torch.cat(logps)[row.numel() // 2:]
        total += float((ref.exp() * (ref - logp)).sum())
        count += logp.shape[0]
    return total / count


@torch.no_grad()
def reference_logprobs(model, input_ids: torch.Tensor, chunk: int = 256) -> list[torch.Tensor]:
    """The default cache's next-token log-probabilities over the second half of each sequence, fed `chunk` tokens at
    a time (what `_kl_of` compares a cache with)."""
    from transformers import DynamicCache

    reference = []
    for row in input_ids:
        cache = DynamicCache(config=model.config)
        logps = [model(row[None, s:s + chunk], cache=cache, use_cache=True).logits[0].float().log_softmax(-1)
                 for s in range(0, row.numel(), chunk)]
        reference.append(torch.cat(logps)[row.numel() // 2:])
    return reference


# the key layouts `choose_rotate` tries, by the name their KL is stored under: the options each changes (rotated keys
# look Gaussian, so Lloyd-Max levels may fit them)
# ("v" leaves the levels to the defaults: Lloyd-Max for 2-bit keys, else uniform)
# rotated keys leave no stream a file's codebooks were fitted for (values are rotated in every choice)
KEY_CHOICES = {"v": {"rotate": "v"}, "kv": {"rotate": "kv", "levels": "uniform", "codebooks": False},
               "kv+lloyd-max": {"rotate": "kv", "levels": "lloyd-max", "codebooks": False}}


@torch.no_grad()
def choose_rotate(model, input_ids: torch.Tensor, options: QuantCacheConfig, chunk: int = 256,
                  reference: list[torch.Tensor] | None = None, try_levels: bool = True
                  ) -> tuple[QuantCacheConfig, dict[str, float]]:
    """Whether this model's keys should be rotated too, and with which levels: the KL (against the default cache,
    scored like `measure_sensitivities`) of `options` with values rotated only (`rotate="v"`, keys unrotated), with keys
    and values rotated (`rotate="kv"`) and, with `try_levels`, rotated keys on data-free Lloyd-Max levels
    (`KEY_CHOICES`); calibrated codebooks are left out of all. Returns `options` with the lowest  and the KLs by name ("v", "kv", "kv+lloyd-max"). Rotated keys help some models and
    hurt others (SmolLM2-135M at 2 bits: Δ PPL +15 % unrotated, +5 % rotated; Gemma-3-270M the other way round)."""
    from qcache.cache import QuantCache

    if options.rotation == "none":
        raise ValueError("choosing which streams to rotate needs rotation='hadamard'; got rotation='none'")
    if reference is None:
        reference = reference_logprobs(model, input_ids, chunk)
    kls, changes = {}, {}
    for name, change in KEY_CHOICES.items():
        if not try_levels:  # the levels were given: keep them
            if name == "kv+lloyd-max":
                continue
            change = {k: v for k, v in change.items() if k != "levels"}
        changes[name] = change
        opts = dataclasses.replace(options, **{**change, "codebooks": False})
        kls[name] = _kl_of(model, input_ids, lambda: QuantCache(model.config, options=opts), reference, chunk)
    best = min(kls, key=kls.get)  # a tie keeps the first: keys unrotated
    return dataclasses.replace(options, **changes[best]), kls


@torch.no_grad()
def measure_sensitivities(model, input_ids: torch.Tensor, options: QuantCacheConfig, quantized: list[int],
                          widths: tuple[int, ...] = PLAN_BITS, chunk: int = 256, progress: bool = True,
                          reference: list[torch.Tensor] | None = None
                          ) -> tuple[dict[tuple[int, str, int], float], float]:
    """{(layer, "k"|"v", width): sensitivity} for every layer in `quantized` (see the module docstring), and the KL
    of the all-8-bit cache they are measured from. `options` are the cache's other options (rotation, groups, ...);
    `reference`: `reference_logprobs` of `input_ids`, if already computed."""
    from qcache.cache import QuantCache

    text_config = model.config.get_text_config(decoder=True)
    num_layers = int(text_config.num_hidden_layers)
    if reference is None:
        reference = reference_logprobs(model, input_ids, chunk)

    def kl_with(pairs):
        opts = dataclasses.replace(options, layer_bits=tuple(pairs))
        return _kl_of(model, input_ids, lambda: QuantCache(model.config, options=opts), reference, chunk)

    base_pairs = [(_BASE, _BASE)] * num_layers
    base = kl_with(base_pairs)
    out = {}
    jobs = [(layer, stream, w) for layer in quantized for stream in ("k", "v") for w in widths]
    for layer, stream, w in tqdm(jobs, desc="layer sensitivities", disable=not progress):
        pairs = list(base_pairs)
        pairs[layer] = (w, _BASE) if stream == "k" else (_BASE, w)
        out[(layer, stream, w)] = max(kl_with(pairs) - base, 0.0)
    return out, base


@torch.no_grad()
def needle_floors(model, tokenizer, text: str, options: QuantCacheConfig, quantized: list[int], threshold: float,
                  length: int = 2048, count: int = 16, seed: int = 0, progress: bool = True
                  ) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str, int], float]]:
    """({(layer, stream): narrowest width whose needle loss is at most `threshold`}, {(layer, stream, width): loss})
    (see the module docstring). `text` is the haystack (calibration text); `count` needles in `length` tokens."""
    from calibration.needles import build_needles, fill_cache, score_needles
    from qcache.cache import QuantCache

    if not threshold > 0:
        raise ValueError(f"needle threshold={threshold!r} must be > 0 nats")
    num_layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    ids, needles = build_needles(tokenizer, text, length, count, seed=seed)

    def answer_logprob(pairs) -> float:
        opts = dataclasses.replace(options, layer_bits=tuple(pairs))
        scores = score_needles(model, fill_cache(model, QuantCache(model.config, options=opts), ids), needles)
        return sum(x.logprob for x in scores) / len(scores)

    base_pairs = [(_BASE, _BASE)] * num_layers
    base = answer_logprob(base_pairs)
    floors, losses = {}, {}
    for layer, stream in tqdm([(la, st) for la in quantized for st in ("k", "v")], desc="needle floors",
                              disable=not progress):
        floors[(layer, stream)] = FLOOR_BITS[-1]
        for w in PLAN_BITS:
            pairs = list(base_pairs)
            pairs[layer] = (w, _BASE) if stream == "k" else (_BASE, w)
            losses[(layer, stream, w)] = loss = max(base - answer_logprob(pairs), 0.0)
            if loss <= threshold:
                floors[(layer, stream)] = w
                break
    return floors, losses


def plan_bits_per_value(options: QuantCacheConfig, pairs, quantized: list[int], kv_heads: int, head_dim: int,
                        context: int) -> float:
    """Bits per value a plan holds at `context` tokens, over the quantized layers (`bytes_per_token` of their
    `layer_bits`: codes, scales, full-precision tokens and positions)."""
    plan = dataclasses.replace(options, layer_bits=tuple(tuple(pairs[layer]) for layer in quantized))
    return layout.bytes_per_token(plan, len(quantized), kv_heads, head_dim, context) * 8 / (len(quantized) * kv_heads
                                                                                   * head_dim * 2)


def allocate(sensitivities: dict[tuple[int, str, int], float], options: QuantCacheConfig, budget: float,
             num_layers: int, quantized: list[int], kv_heads: int, head_dim: int, context: int,
             widths: tuple[int, ...] = PLAN_BITS, floors: dict[tuple[int, str], int] | None = None
             ) -> tuple[tuple[int, int], ...]:
    """One (k_bits, v_bits) per layer within `budget` bits/value (see the module docstring); layers not in
    `quantized` (kept native) get the narrowest pair. `floors` ({(layer, "k"|"v"): width}, `needle_floors`): the
    widths those streams start from (at least; a floor above `widths` stays as it is). Raises if even the
    narrowest plan is over the budget."""
    widths = tuple(sorted(widths))
    floors = floors or {}
    pairs = [[max(widths[0], floors.get((layer, st), widths[0])) for st in ("k", "v")] for layer in range(num_layers)]
    lowest = plan_bits_per_value(options, pairs, quantized, kv_heads, head_dim, context)
    if lowest > budget:
        what = "with the needle floors" if floors else f"{widths[0]}-bit keys and values"
        raise ValueError(f"budget {budget} bits/value is below the narrowest plan ({what}: {lowest:.3f} bits/value "
                         f"at {context} tokens); allowed: a budget of at least that")
    # bits/value is a mean over layers, so widening one layer changes it by that layer's own difference
    def layer_bits(pair) -> float:
        return plan_bits_per_value(options, [pair], [0], kv_heads, head_dim, context) / len(quantized)

    total = lowest
    index = {"k": 0, "v": 1}
    while True:
        best, best_gain = None, 0.0
        for layer in quantized:
            for stream, i in index.items():
                w = pairs[layer][i]
                if w >= widths[-1]:
                    continue
                nxt = widths[widths.index(w) + 1]
                gain = sensitivities[(layer, stream, w)] - sensitivities[(layer, stream, nxt)]
                wider = list(pairs[layer])
                wider[i] = nxt
                cost = layer_bits(wider) - layer_bits(pairs[layer])
                if gain > best_gain and total + cost <= budget:
                    best, best_gain = (layer, wider, cost), gain
        if best is None:
            return tuple((int(kb), int(vb)) for kb, vb in pairs)
        layer, pairs[layer], cost = best
        total += cost
