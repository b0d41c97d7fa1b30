"""Does the weight-only rule of `rotate="auto"` (qcache/keyrot.py) pick the key rotation real queries would?

    python bench/key_rotation.py --models smollm2-135m gemma3-270m --out docs/results/key-rotation

Per model and layer, two numbers for the score error of rotated over unrotated keys (below 1: rotate):
- `rule`: what `rotate="auto"` decides by, from the q_proj/k_proj (and q_norm/k_norm) weights alone
  (`qcache.keyrot.weight_energies`, `key_rotation_ratio`);
- `measured`: keys and queries recorded on `--tokens` tokens of the eval split (`calibration.collect`: pre-RoPE keys,
  per-channel query energy over RoPE pairs), keys quantized per channel in 128-token blocks at `--bits` min-max,
  unrotated and through the cache's Hadamard rotation; the query-energy weighted squared error, rotated over
  unrotated.
A layer agrees when both sit on the same side of 1. Layers the default cache quantizes (global ones; a model's
sliding layers stay native) are marked. Not a test: a minute per model on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fake_quant_channels(k: torch.Tensor, bits: int, block: int = 128) -> torch.Tensor:
    """[H, N, D] keys -> quantized and read back per channel over blocks of `block` tokens (N a multiple of it), with
    the cache's min-max quantizer (`qcache.quant`, float16 scales)."""
    from qcache.quant import dequantize_grouped, quantize_grouped

    codes, scale, zero = quantize_grouped(k, bits, block, dim=1)
    return dequantize_grouped(codes, scale, zero, block, dim=1)


def measure(model_name: str, tokens: int, bits: int, threads: int) -> dict:
    from calibration.collect import collect_statistics
    from qcache.tools.data import token_sequences
    from qcache.keyrot import key_rotation_ratio, rotary_width, weight_energies
    from qcache.tools.models import load_model
    from qcache.rotation import hadamard_rotation

    torch.set_num_threads(threads)
    model, tok = load_model(model_name, dtype=torch.float32)
    cfg = model.config.get_text_config(decoder=True)
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rot_dim = rotary_width(cfg)
    R = hadamard_rotation(D, 0)  # the cache's matrix (rotation_seed=0)
    ids = token_sequences(tok, "eval", 1, tokens)
    stats = collect_statistics(model, ids, progress=False)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    modules = {m.layer_idx: m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")}
    rows = []
    for idx in sorted(stats):
        q_e, k_e = weight_energies(modules[idx], cfg.num_attention_heads, cfg.num_key_value_heads, D, rot_dim)
        rule = key_rotation_ratio(q_e, k_e, R)
        k, w = stats[idx]["keys"], stats[idx]["k_weight"]  # [H, N, D] pre-RoPE keys, [H, D] query energy
        n = k.shape[1] // 128 * 128
        k = k[:, :n]
        err_u = fake_quant_channels(k, bits) - k
        err_r = fake_quant_channels(k @ R, bits) @ R.T - k
        measured = float((err_r.pow(2) * w[:, None]).sum() / (err_u.pow(2) * w[:, None]).sum())
        rows.append({"layer": idx, "type": types[idx], "rule": rule, "measured": measured,
                     "agree": (rule < 1) == (measured < 1)})
    return {"model": model_name, "tokens": tokens, "bits": bits, "layers": rows}


def table(run: dict) -> str:
    lines = [f"## {run['model']}: {run['tokens']} eval-split tokens, {run['bits']}-bit keys", "",
             "| layer | type | rule (weights) | measured (queries, keys) | keys rotated by auto | agree |",
             "|---:|---|---:|---:|---|---|"]
    for r in run["layers"]:
        quantized = r["type"] == "full_attention"
        lines.append(f"| {r['layer']} | {r['type']}{'' if quantized else ' (native by default)'} | {r['rule']:.2f} | "
                     f"{r['measured']:.2f} | {'yes' if r['rule'] < 1 else 'no'} | {'yes' if r['agree'] else '**no**'} |")
    glob = [r for r in run["layers"] if r["type"] == "full_attention"]
    lines += ["", f"Agree: {sum(r['agree'] for r in run['layers'])} of {len(run['layers'])} layers; "
              f"{sum(r['agree'] for r in glob)} of {len(glob)} global (default-quantized) layers.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    from eval.provenance import git_state

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--bits", type=int, choices=(2, 3, 4), default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True, help="path stem: writes STEM.json and STEM.md")
    a = p.parse_args(argv)
    start = time.time()
    runs = [measure(m, a.tokens, a.bits, a.threads) for m in a.models]
    git = git_state()
    meta = {"command": "python bench/key_rotation.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "git": git, "seconds": round(time.time() - start, 1), "torch": torch.__version__}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({**meta, "runs": runs}, indent=1) + "\n")
    head = [f"# Key rotation: the weight rule of rotate='auto' against real queries", "",
            f"Command: `{meta['command']}`", "",
            f"git {git['commit'][:10] if git else '?'} ({'dirty' if git and git['dirty'] else 'clean'} tree); "
            f"{meta['seconds']} s; torch {torch.__version__}; weights float32.", "",
            "Score error of rotated over unrotated keys (below 1: rotating wins), per layer: `rule` from the weights "
            "alone (what the cache decides by), `measured` from recorded queries and keys (query-energy weighted "
            "squared error of per-channel min-max keys in 128-token blocks, unrotated vs through the cache's "
            "Hadamard matrix). See bench/key_rotation.py.", ""]
    a.out.with_suffix(".md").write_text("\n".join(head) + "\n" + "\n".join(table(r) for r in runs))
    print(a.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
