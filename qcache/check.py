"""Smoke test of the installed transformers: QuantCache at 8 bits against DynamicCache on tiny random models.

    python -m qcache.check                      # a few common families, a line each, in seconds (no downloads)
    python -m qcache.check --families llama gemma3_text --steps 40

For each family: a tiny random model built from a config of the installed transformers (2 layers, hidden 64, vocab
128, fp32, weights from `torch.manual_seed(0)` with `initializer_range` 0.02), a prompt of 48 random tokens, then
greedy steps through `generate(cache=...)` once with `DynamicCache` and once with
`QuantCache(bits=8, sink_tokens=4, recent_tokens=16, k_group_size=16)`: 4 sinks + 16 recent tokens + the block being
filled leave 16 prompt tokens quantized after the prefill, so the steps read quantized keys and values. The outcome:

    match      max |delta logit| over the steps <= LOGIT_TOLERANCE x the std of the reference logits, quantized
               tokens in the cache, and the same greedy tokens; or tokens that part at a near tie: a step where
               DynamicCache's own top-2 margin is under 2 x LOGIT_TOLERANCE x std, which any cache within the
               tolerance may break either way (the logits are then compared along DynamicCache's tokens, fed one
               at a time through a fresh QuantCache, as generate feeds them)
    refused    a ValueError raised by the first forward, before the cache stored anything, whose message names
               the family's problem (`Family.refusal`: e.g. no RoPE, another RoPE layout)
    failed     anything else: different tokens or logits, nothing quantized, another exception, a refusal that does
               not name the problem, or an error after the cache stored tokens

`bench/coverage_matrix.py` runs the same check over every decoder family and writes the table the README shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["Refusal", "Family", "Outcome", "SMOKE_FAMILIES", "CACHE_OPTIONS", "LOGIT_TOLERANCE", "tiny_config",
           "build_model", "check_family", "main"]

CACHE_OPTIONS = dict(bits=8, sink_tokens=4, recent_tokens=16, k_group_size=16)
PROMPT_TOKENS = 48
STEPS = 40
# max |delta logit| allowed, as a fraction of the std of the reference logits
LOGIT_TOLERANCE = 0.05

# shared by every family; a config takes the fields it has (by name or through its attribute_map). Mixture-of-experts
# configs get 4 experts, all active: top-k routing is discontinuous, a near tie between experts turns any small
# change of the hidden state (8-bit noise included) into another expert and a jump in the logits that says nothing
# about the cache.
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, max_position_embeddings=512, initializer_range=0.02,
            pad_token_id=0, bos_token_id=1, eos_token_id=None, tie_word_embeddings=False,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=4, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, n_group=1, topk_group=1)
SLIDING_THEN_FULL = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=32)


@dataclass(frozen=True)
class Refusal:
    """What QuantCache may refuse a family for instead of matching: the ValueError's message must contain `pattern`
    (a regex) and so name the `problem`."""

    problem: str
    pattern: str


@dataclass(frozen=True)
class Family:
    """One decoder family: a short key (test id, --families), its name in a table, model_type, config overrides on
    top of TINY, a note for the table, and the refusal allowed instead of a match (None: it must match)."""

    key: str
    name: str
    model_type: str
    overrides: dict = field(default_factory=dict)
    note: str = ""
    refusal: Refusal | None = None


NO_ROPE = Refusal("the missing RoPE", r"no RoPE|rope_parameters is None")

# the families most checkpoints on the hub belong to, one of each RoPE binding that differs (interleaved pairs, no
# position_ids), and one that must be refused (no RoPE)
SMOKE_FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama", "llama"),
    Family("qwen2", "Qwen2", "qwen2"),
    Family("mistral", "Mistral", "mistral", dict(sliding_window=None)),
    Family("qwen3", "Qwen3", "qwen3", note="q/k norm"),
    Family("gemma3_text", "Gemma 3 (text)", "gemma3_text", dict(SLIDING_THEN_FULL, query_pre_attn_scalar=16),
           "sliding + full layers, RoPE per layer type, q/k norm"),
    Family("phi3", "Phi-3", "phi3", dict(sliding_window=None)),
    Family("cohere", "Cohere", "cohere", note="interleaved RoPE pairs"),
    Family("gpt_neox", "GPT-NeoX", "gpt_neox", note="no position_ids to the cache"),
    Family("gpt2", "GPT-2", "gpt2", note="learned positions", refusal=NO_ROPE),
)


@dataclass
class Outcome:
    """What one family did (see the module docstring for `kind`)."""

    key: str
    family: str
    model_type: str
    kind: str  # "match", "refused" or "failed"
    detail: str  # the outcome in words
    max_dlogit: float | None = None
    logit_std: float | None = None
    tokens_equal: bool | None = None
    first_different_step: int | None = None
    margin_there: float | None = None  # DynamicCache's top-2 margin at that step, as a fraction of the logits' std
    lossy_control: float | None = None  # bench/coverage_matrix.py: max |delta logit| / std of a lossy cache
    control_error: str | None = None  # why the control could not run
    quantized_tokens: int | None = None
    error: str | None = None
    traceback: list[str] | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _config_fields(cls) -> set[str]:
    return set(getattr(cls, "__dataclass_fields__", {})) | set(getattr(cls, "attribute_map", {}) or {})


def tiny_config(family: Family):
    """The family's config from the installed transformers: the TINY fields it has, then the family's overrides."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family.model_type]
    known = _config_fields(cls)
    kwargs = {k: v for k, v in TINY.items() if k in known}
    kwargs.update(family.overrides)
    return cls(**kwargs)


def build_model(family: Family):
    """A tiny random fp32 causal LM of the family (seed 0), in eval mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prompt_for(model) -> torch.Tensor:
    """The fixed random prompt [1, PROMPT_TOKENS] (seed 1) within the model's vocabulary."""
    vocab = model.get_output_embeddings().weight.shape[0]
    return torch.randint(3, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))  # [1, P]


@torch.no_grad()
def greedy(model, prompt: torch.Tensor, cache, steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` greedy tokens [steps] and their logits [steps, V] through `cache`."""
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache, max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    return out.sequences[0, prompt.shape[1]:], torch.cat(out.logits).float()  # [steps], [steps, V]


@torch.no_grad()
def teacher_forced(model, prompt: torch.Tensor, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Logits [steps, V] of the prompt and then `tokens` [steps] fed one at a time through `cache`."""
    logits = [model(prompt, cache=cache, use_cache=True).logits[0, -1]]
    for token in tokens[:-1]:
        logits.append(model(token.view(1, 1), cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(logits).float()


def _frames(err: BaseException, n: int = 4) -> list[str]:
    return [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_tb(err.__traceback__)[-n:]]


def _stored_tokens(cache) -> int:
    return sum(layer.get_seq_length() for layer in cache.layers if getattr(layer, "is_initialized", False))


def _quantized_tokens(cache) -> int:
    return sum(getattr(layer, "quantized_length", 0) or 0 for layer in cache.layers)


def _refused(outcome: Outcome, family: Family, err: Exception, stored: int) -> None:
    """Classify an exception of QuantCache's run (see the module docstring)."""
    outcome.error = f"{type(err).__name__}: {err}"
    outcome.traceback = _frames(err)
    named = family.refusal is None or re.search(family.refusal.pattern, str(err)) is not None
    if isinstance(err, ValueError) and stored == 0 and named:
        outcome.kind, outcome.detail = "refused", f"refused: {outcome.error}"
    elif isinstance(err, ValueError) and stored == 0:
        outcome.detail = f"failed: refused without naming {family.refusal.problem}: {outcome.error}"
    elif isinstance(err, ValueError):
        outcome.detail = f"failed: ValueError after {stored} tokens were stored: {err}"
    else:
        outcome.detail = f"failed: {outcome.error} (at {outcome.traceback[-1]})"


def check_family(family: Family, steps: int = STEPS) -> tuple[Outcome, tuple | None]:
    """Run the family through DynamicCache and QuantCache (8 bits) for `steps` greedy steps and classify what
    QuantCache did. Returns the outcome and, for a match, (model, prompt, reference tokens, reference logits) for
    further checks on the same run (bench/coverage_matrix.py's control)."""
    from transformers import DynamicCache

    from .cache import QuantCache

    start = time.perf_counter()
    model = build_model(family)
    prompt = prompt_for(model)
    ref_tokens, ref_logits = greedy(model, prompt, DynamicCache(config=model.config), steps)
    outcome = Outcome(family.key, family.name, family.model_type, "failed", "")
    cache = QuantCache(**CACHE_OPTIONS)
    try:
        tokens, logits = greedy(model, prompt, cache, steps)
    except Exception as err:  # classified, not swallowed: every exception ends up in the outcome
        _refused(outcome, family, err, _stored_tokens(cache))
        outcome.seconds = time.perf_counter() - start
        return outcome, None
    std = float(ref_logits.std())
    outcome.logit_std = std
    outcome.quantized_tokens = _quantized_tokens(cache)
    outcome.tokens_equal = bool(torch.equal(tokens, ref_tokens))
    near_tie = True
    tokens_text = f"{steps}/{steps} tokens equal"
    if not outcome.tokens_equal:  # compare the logits along DynamicCache's tokens
        step = int((tokens != ref_tokens).nonzero()[0, 0])
        top2 = ref_logits[step].topk(2).values
        outcome.first_different_step = step
        outcome.margin_there = float(top2[0] - top2[1]) / std
        near_tie = outcome.margin_there < 2 * LOGIT_TOLERANCE
        tokens_text = (f"tokens equal for {step} steps, then a {'near tie' if near_tie else 'different token'} "
                       f"(DynamicCache's top-2 margin {outcome.margin_there:.2%} of the std)")
        logits = teacher_forced(model, prompt, ref_tokens, QuantCache(**CACHE_OPTIONS))
    outcome.max_dlogit = float((logits - ref_logits).abs().max())
    within = outcome.max_dlogit <= LOGIT_TOLERANCE * std
    numbers = (f"max |Δ logit| {outcome.max_dlogit:.1e} = {outcome.max_dlogit / std:.2%} of the logits' std, "
               f"{tokens_text}, {outcome.quantized_tokens} tokens quantized")
    run = None
    if outcome.quantized_tokens == 0:
        outcome.detail = f"failed: nothing was quantized ({numbers})"
    elif within and near_tie:
        outcome.kind, outcome.detail = "match", f"matches DynamicCache at 8 bits ({numbers})"
        run = (model, prompt, ref_tokens, ref_logits)
    else:
        outcome.detail = f"failed: differs from DynamicCache at 8 bits ({numbers})"
    outcome.seconds = time.perf_counter() - start
    return outcome, run


def _line(outcome: Outcome) -> str:
    words = {"match": "ok", "refused": "refused", "failed": "FAILED"}[outcome.kind]
    detail = outcome.detail.split(": ", 1)[1] if outcome.kind != "match" else outcome.detail
    return f"{outcome.family:<16} {words:<8} {detail}"


def main(argv: list[str] | None = None) -> int:
    keys = [f.key for f in SMOKE_FAMILIES]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=keys, default=keys, metavar="KEY",
                        help=f"families to check (default: all of {', '.join(keys)})")
    parser.add_argument("--steps", type=int, default=20, help="greedy tokens per cache (default 20)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    import transformers

    from ._compat import binding_report

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # tiny models: one thread is several times faster than two busy ones
    print(binding_report())
    failed = 0
    for family in (f for f in SMOKE_FAMILIES if f.key in args.families):
        outcome, _ = check_family(family, steps=args.steps)
        # a family allowed a refusal may be refused; one that must match and is refused counts as a failure
        failed += outcome.kind == "failed" or (outcome.kind == "refused" and family.refusal is None)
        print(_line(outcome), flush=True)
    print(f"{'all families as expected' if not failed else f'{failed} unexpected'}: "
          f"QuantCache(bits=8) vs DynamicCache, {args.steps} greedy tokens")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
