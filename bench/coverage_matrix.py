"""Model coverage matrix: QuantCache at 8 bits against DynamicCache on a tiny random model of each decoder family.

    python bench/coverage_matrix.py                       # every family, writes docs/results/coverage.{md,json}
    python bench/coverage_matrix.py --families llama gpt_neox --out /tmp/coverage

For each family: `qcache.check.check_family` (a tiny random model, a 48-token prompt, 40 greedy steps through
DynamicCache and `QuantCache(bits=8)`; qcache/check.py says what counts as match, refused and failed), plus a control
for each matching family: how far a cache that loses its quantized region lands outside the tolerance.

`tests/test_coverage.py` runs the same checks per family. Not a test itself: it writes the table the README shows.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from qcache.check import (  # the per-family check itself; this file runs it over every family
    CACHE_OPTIONS,
    NO_ROPE,
    LOGIT_TOLERANCE,
    PROMPT_TOKENS,
    SLIDING_THEN_FULL,
    STEPS,
    Family,
    Outcome,
    Refusal,
    build_model,
    greedy,
    prompt_for,
    teacher_forced,
    tiny_config,
)
from qcache.check import check_family as _check

__all__ = ["Family", "Outcome", "FAMILIES", "LOGIT_TOLERANCE", "CACHE_OPTIONS", "tiny_config", "build_model",
           "check_family", "lossy_control", "render_markdown", "main"]

log = logging.getLogger("coverage_matrix")

# multi-head latent attention: 4 heads of 16 + 8 rotary channels from a 32-wide latent
MLA = dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
           v_head_dim=16, first_k_dense_replace=1)


LAYOUT = Refusal("the RoPE layout", r"layout qcache does not undo|apply_rotary_pos_emb")
KV_WIDTHS = Refusal("keys and values of different widths", r"(?s)head_dim.*value|value.*head_dim|latent")
PER_LAYER_HEAD_DIM = Refusal("the head_dim per layer", r"head_dim")
CHUNKED = Refusal("the RoPE layout or the chunked layers", LAYOUT.pattern + r"|chunked_attention")
HYBRID = Refusal("the non-attention layers", r"linear_attention|mamba|hybrid|layer type")
LATENT = Refusal("the latent cache or its RoPE layout", KV_WIDTHS.pattern + "|" + LAYOUT.pattern)


FAMILIES: tuple[Family, ...] = (
    # the families named in the README and issues first, then the rest of the installed decoders that build
    # offline from a config (no hub access) and whose attention uses the cache
    Family("llama", "Llama", "llama"),
    Family("mistral", "Mistral", "mistral", dict(sliding_window=None)),
    Family("mistral_sliding", "Mistral, sliding window 32", "mistral", dict(sliding_window=32),
           "window shorter than the text (what lies beyond it is masked: the control cannot move it)"),
    Family("mixtral", "Mixtral", "mixtral", dict(sliding_window=None), "MoE"),
    Family("qwen2", "Qwen2", "qwen2"),
    Family("qwen2_moe", "Qwen2-MoE", "qwen2_moe", note="MoE"),
    Family("qwen3", "Qwen3", "qwen3", note="q/k norm"),
    Family("qwen3_moe", "Qwen3-MoE", "qwen3_moe", note="MoE, q/k norm"),
    Family("gemma", "Gemma", "gemma"),
    Family("gemma2", "Gemma 2", "gemma2", dict(SLIDING_THEN_FULL, query_pre_attn_scalar=16),
           "sliding + full layers, attention softcapping"),
    Family("gemma3_text", "Gemma 3 (text)", "gemma3_text", dict(SLIDING_THEN_FULL, query_pre_attn_scalar=16),
           "sliding + full layers, RoPE per layer type, q/k norm"),
    Family("gemma4_text", "Gemma 4 (text)", "gemma4_text", dict(SLIDING_THEN_FULL),
           "sliding + full layers, head_dim per layer type, partial rotary", refusal=PER_LAYER_HEAD_DIM),
    Family("vaultgemma", "VaultGemma", "vaultgemma", dict(SLIDING_THEN_FULL, query_pre_attn_scalar=16),
           "sliding + full layers"),
    Family("phi3", "Phi-3", "phi3", dict(sliding_window=None)),
    Family("phimoe", "PhiMoE", "phimoe", dict(sliding_window=None), "MoE"),
    Family("phi", "Phi", "phi", note="partial rotary (50 %)"),
    Family("olmo", "OLMo", "olmo"),
    Family("olmo2", "OLMo 2", "olmo2", note="q/k norm"),
    Family("olmo3", "OLMo 3", "olmo3", dict(SLIDING_THEN_FULL), "sliding + full layers, q/k norm"),
    Family("olmoe", "OLMoE", "olmoe", note="MoE, q/k norm"),
    Family("flex_olmo", "FlexOlmo", "flex_olmo", note="MoE, q/k norm"),
    Family("granite", "Granite", "granite"),
    Family("granitemoe", "GraniteMoE", "granitemoe", note="MoE"),
    Family("granitemoeshared", "GraniteMoE (shared experts)", "granitemoeshared", note="MoE"),
    Family("stablelm", "StableLM", "stablelm", note="partial rotary (25 %), no position_ids to the cache"),
    Family("gpt_neox", "GPT-NeoX", "gpt_neox", note="partial rotary (25 %), no position_ids to the cache"),
    Family("persimmon", "Persimmon", "persimmon", note="partial rotary (50 %), q/k norm, no position_ids to the cache"),
    Family("nemotron", "Nemotron", "nemotron", note="partial rotary (50 %)"),
    Family("starcoder2", "Starcoder2", "starcoder2", dict(sliding_window=None)),
    Family("cohere", "Cohere", "cohere", note="interleaved RoPE pairs"),
    Family("cohere2", "Cohere2", "cohere2", dict(SLIDING_THEN_FULL), "sliding + full layers, interleaved RoPE pairs"),
    Family("falcon", "Falcon", "falcon", dict(new_decoder_architecture=True, num_kv_heads=2),
           "no position_ids to the cache"),
    Family("gptj", "GPT-J", "gptj", dict(rotary_dim=8), "rotary on 8 of 16 channels", refusal=NO_ROPE),
    Family("codegen", "CodeGen", "codegen", dict(rotary_dim=8), "rotary on 8 of 16 channels", refusal=NO_ROPE),
    Family("smollm3", "SmolLM3", "smollm3", dict(no_rope_layers=[1, 0]), "layer 1 without RoPE (NoPE)"),
    Family("glm", "GLM", "glm", note="partial rotary (50 %), interleaved RoPE pairs"),
    Family("glm4", "GLM-4", "glm4", note="partial rotary (50 %), interleaved RoPE pairs"),
    Family("glm4_moe", "GLM-4-MoE", "glm4_moe", dict(first_k_dense_replace=1), "MoE, partial rotary (50 %)"),
    Family("helium", "Helium", "helium", note="interleaved RoPE pairs"),
    Family("gpt_oss", "GPT-OSS", "gpt_oss", dict(SLIDING_THEN_FULL),
           "MoE, sliding + full layers, YaRN, cos/sin per rotated pair, attention sinks"),
    Family("ministral", "Ministral", "ministral", dict(SLIDING_THEN_FULL), "sliding + full layers"),
    Family("ministral3", "Ministral 3", "ministral3", note="YaRN, no position_ids to the cache"),
    Family("exaone", "EXAONE", "exaone"),
    Family("exaone4", "EXAONE 4", "exaone4", dict(SLIDING_THEN_FULL), "sliding + full layers, q/k norm"),
    Family("internlm3", "InternLM3", "internlm3"),
    Family("seed_oss", "Seed-OSS", "seed_oss"),
    Family("hunyuan_v1_dense", "Hunyuan (dense)", "hunyuan_v1_dense"),
    Family("hunyuan_v1_moe", "Hunyuan (MoE)", "hunyuan_v1_moe", note="MoE"),
    Family("apertus", "Apertus", "apertus", note="llama3 RoPE, q/k norm"),
    Family("arcee", "Arcee", "arcee"),
    Family("bitnet", "BitNet", "bitnet", note="ternary weights, 8-bit activations"),
    Family("doge", "Doge", "doge", note="q/k norm"),
    Family("cwm", "CWM", "cwm", note="sliding + full layers, llama3 RoPE"),
    Family("dots1", "dots.llm1", "dots1", dict(first_k_dense_replace=1, n_shared_experts=1), "MoE, q/k norm"),
    Family("ernie4_5", "ERNIE 4.5", "ernie4_5", note="interleaved RoPE pairs"),
    Family("jetmoe", "JetMoE", "jetmoe", note="MoE"),
    Family("afmoe", "AFMoE", "afmoe", dict(SLIDING_THEN_FULL), "MoE, sliding + full layers, q/k norm"),
    Family("kolibri1", "Kolibri", "kolibri1", dict(SLIDING_THEN_FULL),
           "MoE, sliding + full layers, no RoPE on full layers"),
    Family("minimax_m2", "MiniMax-M2", "minimax_m2", note="MoE, q/k norm"),
    Family("solar_open", "Solar Open", "solar_open", note="MoE"),
    Family("deepseek_v2", "DeepSeek-V2", "deepseek_v2", dict(MLA), "MLA (caches the latent), MoE", refusal=LATENT),
    Family("deepseek_v3", "DeepSeek-V3", "deepseek_v3", dict(MLA), "MLA (caches the latent), MoE", refusal=KV_WIDTHS),
    Family("minicpm3", "MiniCPM3", "minicpm3", dict(MLA), "MLA (caches the latent)", refusal=KV_WIDTHS),
    Family("mimo_v2_flash", "MiMo-V2-Flash", "mimo_v2_flash", dict(SLIDING_THEN_FULL, head_dim=32, v_head_dim=64),
           "values wider than keys, sliding layers with their own kv heads and sinks"),
    Family("llama4_text", "Llama 4 (text)", "llama4_text", note="chunked attention layers, MoE", refusal=CHUNKED),
    Family("falcon_h1", "Falcon-H1", "falcon_h1", note="hybrid: Mamba + attention in every layer", refusal=HYBRID),
    Family("qwen3_next", "Qwen3-Next", "qwen3_next", dict(layer_types=["linear_attention", "full_attention"]),
           "hybrid: linear-attention + full layers", refusal=HYBRID),
    Family("gpt2", "GPT-2", "gpt2", note="learned positions", refusal=NO_ROPE),
    Family("gpt_bigcode", "GPT-BigCode", "gpt_bigcode", note="learned positions, MQA", refusal=NO_ROPE),
    Family("opt", "OPT", "opt", note="learned positions", refusal=NO_ROPE),
    Family("bloom", "BLOOM", "bloom", note="ALiBi", refusal=NO_ROPE),
    Family("xglm", "XGLM", "xglm", note="sinusoidal positions", refusal=NO_ROPE),
)


def _lossy_cache(config, keep_first: int, keep_last: int):
    """A DynamicCache whose one-token steps attend to the first `keep_first` and the last `keep_last` tokens only
    (full precision): what a cache that lost its quantized region would return."""
    from transformers import DynamicCache

    class LossyCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)  # [B, H, T, D]
            if key_states.shape[2] == 1 and keys.shape[2] > keep_first + keep_last:
                keys = torch.cat([keys[:, :, :keep_first], keys[:, :, -keep_last:]], dim=2)
                values = torch.cat([values[:, :, :keep_first], values[:, :, -keep_last:]], dim=2)
            return keys, values

    return LossyCache(config=config)


def lossy_control(family: Family) -> float:
    """max |delta logit| / std of the reference logits for a cache that keeps the sinks and the full-precision
    window of CACHE_OPTIONS but drops the region QuantCache quantizes (compared along DynamicCache's tokens): how far
    outside LOGIT_TOLERANCE a cache that loses tokens lands."""
    from transformers import DynamicCache

    model = build_model(family)
    prompt = prompt_for(model)
    return _lossy_ratio(model, prompt, *greedy(model, prompt, DynamicCache(config=model.config)))


def _lossy_ratio(model, prompt: torch.Tensor, ref_tokens: torch.Tensor, ref_logits: torch.Tensor) -> float:
    keep_last = CACHE_OPTIONS["recent_tokens"] + CACHE_OPTIONS["k_group_size"]
    cache = _lossy_cache(model.config, CACHE_OPTIONS["sink_tokens"], keep_last)
    logits = teacher_forced(model, prompt, ref_tokens, cache)
    return float((logits - ref_logits).abs().max() / ref_logits.std())


def check_family(family: Family, control: bool = False) -> Outcome:
    """`qcache.check.check_family` over STEPS steps; with `control`, a matching family also gets `lossy_control`
    (see there) on the same model and reference run."""
    outcome, run = _check(family, steps=STEPS)
    if control and run is not None:
        try:
            outcome.lossy_control = _lossy_ratio(*run)
        except RuntimeError as err:  # attention whose mask has a column per stored token: no control there
            outcome.control_error = f"{type(err).__name__}: {err}"
    return outcome


# why a family was refused, by a phrase of its ValueError (first match wins) -> the summary's wording
REFUSAL_REASONS = (
    ("has no RoPE parameters", "no RoPE (learned positions, ALiBi or none)"),
    ("rotates keys with a layout", "a RoPE layout other than rotate-half or interleaved pairs (`rope='post'` allowed)"),
    ("convolution/recurrent state", "a recurrent or convolution state (Mamba, linear attention)"),
    ("head_dim per layer", "head_dim set per layer"),
    ("latent and rotary part", "multi-head latent attention (its latent cached in place of keys and values)"),
    ("keys with head_dim", "keys and values of different head_dim"),
    ("has no apply_rotary_pos_emb", "no apply_rotary_pos_emb(q, k, cos, sin) in its modeling code to check the RoPE "
     "layout against"),
)


def refusal_reason(error: str) -> str:
    """The summary's wording for a refusal (the error's own text when no phrase of REFUSAL_REASONS is in it)."""
    for phrase, reason in REFUSAL_REASONS:
        if phrase in error:
            return reason
    return error.removeprefix("ValueError: ").split(";")[0]


def summary_markdown(outcomes: list[Outcome]) -> str:
    """One row per outcome (refusals per reason) listing the families: the table the README shows."""
    groups: dict[str, list[str]] = {}
    for o in outcomes:
        label = ("matches DynamicCache at 8 bits" if o.kind == "match" else
                 f"refused: {refusal_reason(o.error or o.detail)}" if o.kind == "refused" else
                 f"FAILED: {o.detail}")
        groups.setdefault(label, []).append(o.family)
    lines = ["| outcome | families |", "|---|---|"]
    for label, families in sorted(groups.items(), key=lambda kv: (not kv[0].startswith("matches"), -len(kv[1]))):
        lines.append(f"| {label} ({len(families)}) | {'; '.join(families)} |")
    return "\n".join(lines) + "\n"


def render_markdown(outcomes: list[Outcome], header: dict) -> str:
    notes = {f.key: f.note for f in FAMILIES}
    lines = [
        "# Model coverage: QuantCache at 8 bits vs DynamicCache",
        "",
        f"Command: `{header['command']}` ({header['date']}; qcache {header['qcache']}, transformers "
        f"{header['transformers']}, kernels {header.get('kernels', 'not recorded')}, torch {header['torch']}).",
        "",
        f"Tiny random models (2 layers, hidden 64, vocab 128, fp32, seed 0), a {PROMPT_TOKENS}-token prompt and "
        f"{STEPS} greedy steps through `generate(cache=...)`, once with `DynamicCache` and once with "
        f"`QuantCache({', '.join(f'{k}={v}' for k, v in CACHE_OPTIONS.items())})` (16 prompt tokens quantized after "
        f"the prefill, 64 per full-attention layer after the steps). **matches**: max |Δ logit| over all steps within "
        f"{LOGIT_TOLERANCE:.0%} of the reference logits' std and the same {STEPS} greedy tokens, or tokens that "
        f"part at a near tie (a step where DynamicCache's own top-2 margin is under {2 * LOGIT_TOLERANCE:.0%} of "
        "the std, which any cache within the tolerance may break either way; the logits are then compared along "
        "DynamicCache's tokens). **refused**: a ValueError from the first forward, before the cache stored "
        "anything, whose message names the problem. **failed**: anything else.",
        "",
        "The last column is the control: max |Δ logit| of a full-precision cache that attends to the "
        f"{CACHE_OPTIONS['sink_tokens']} sinks and the newest "
        f"{CACHE_OPTIONS['recent_tokens'] + CACHE_OPTIONS['k_group_size']} tokens only at decode (a cache that lost "
        "its quantized region), as a fraction of the same std: how far outside the tolerance such a loss lands "
        "(n/a: the model's attention mask has a column per stored token, so keys cannot be dropped; see the JSON).",
        "",
        summary_markdown(outcomes),
        "| family | model_type | notes | outcome | control |",
        "|---|---|---|---|---|",
    ]
    for o in outcomes:
        detail = o.detail.replace("|", "\\|").replace("\n", " ")
        control = f"{o.lossy_control:.0%}" if o.lossy_control is not None else "n/a" if o.control_error else ""
        lines.append(f"| {o.family} | `{o.model_type}` | {notes.get(o.key, '')} | {detail} | {control} |")
    counts = {kind: sum(o.kind == kind for o in outcomes) for kind in ("match", "refused", "failed")}
    lines += ["", f"{counts['match']} match, {counts['refused']} refused, {counts['failed']} failed.", ""]
    return "\n".join(lines)


def _installed(package: str) -> str:
    """The installed version of `package`, or "not installed"."""
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _qcache_revision() -> str:
    """The git commit the imported qcache comes from, '+ changes' when its files differ from it."""
    import subprocess

    import qcache

    where = Path(qcache.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--", "."], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"{qcache.__version__} (not a git checkout)"
    return f"{qcache.__version__} at {commit}" + (" + uncommitted changes" if changed else "")


def main(argv: list[str] | None = None) -> int:
    keys = [f.key for f in FAMILIES]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", choices=keys, default=None, metavar="KEY",
                        help=f"families to run (default: all); one of {', '.join(keys)}")
    parser.add_argument("--out", type=Path, default=Path("docs/results/coverage"),
                        help="output path without suffix: writes <out>.md and <out>.json")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="rewrite <out>.md from a JSON this script wrote (no run) and print the summary table")
    args = parser.parse_args(argv)
    if args.render is not None:
        data = json.loads(args.render.read_text())
        outcomes = [Outcome(**o) for o in data.pop("outcomes")]
        Path(f"{args.out}.md").write_text(render_markdown(outcomes, data))
        print(summary_markdown(outcomes))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # tiny models: one thread is several times faster than two busy ones
    from tqdm.auto import tqdm
    import transformers

    transformers.logging.set_verbosity_error()
    chosen = [f for f in FAMILIES if args.families is None or f.key in args.families]
    outcomes = []
    for family in tqdm(chosen, desc="families"):
        outcomes.append(check_family(family, control=True))
        log.info("%s: %s", family.name, outcomes[-1].detail)
    command = ["python", "bench/coverage_matrix.py", *(argv if argv is not None else sys.argv[1:])]
    header = {"command": " ".join(command),
              "date": time.strftime("%Y-%m-%d"), "qcache": _qcache_revision(), "transformers": transformers.__version__,
              "kernels": _installed("kernels"),
              "torch": torch.__version__, "python": platform.python_version(), "cache_options": CACHE_OPTIONS,
              "prompt_tokens": PROMPT_TOKENS, "steps": STEPS, "logit_tolerance": LOGIT_TOLERANCE,
              "families": [f.key for f in chosen]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(
        json.dumps({**header, "outcomes": [o.to_dict() for o in outcomes]}, indent=2) + "\n")
    Path(f"{args.out}.md").write_text(render_markdown(outcomes, header))
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
