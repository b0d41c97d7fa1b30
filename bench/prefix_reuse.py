"""Prefix reuse: a long document prefilled once, saved, loaded in a new process and asked three questions.

    python bench/prefix_reuse.py --model smollm2-135m --context 8192 --out docs/results/prefix-reuse-smollm2-135m

One run on a real checkpoint (offline, converted once): the first `--context` tokens of the eval split are the
document; three questions are the 24 tokens after it, the 24 after those, and so on. Measured, one process after
another on an otherwise idle machine:
- fresh: prefill the document into `QuantCache(bits=4)` and feed the first question (time to its first token);
- saved: `cache.save(path)`: seconds and file bytes; DynamicCache's keys and values saved the same way (safetensors,
  as held) for the size beside it;
- loaded: a new Python process loads the model (not timed), then `QuantCache.load(path, model)`, `fork()`s it per
  question and feeds each question: time to first token per question, and whether the first question's logits equal
  the fresh cache's bit for bit.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QUESTION_TOKENS = 24


def _tokens(tok, context: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    from qcache.tools.data import token_sequences

    seq = token_sequences(tok, "eval", 1, context + 3 * QUESTION_TOKENS)
    doc = seq[:, :context]
    questions = [seq[:, context + i * QUESTION_TOKENS: context + (i + 1) * QUESTION_TOKENS] for i in range(3)]
    return doc, questions


def _ask(model, cache, question: torch.Tensor, start: int) -> tuple[torch.Tensor, float]:
    """Feed one question after `start` cached tokens: its last logits and the seconds it took."""
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(question, cache=cache, use_cache=True,
                    position_ids=torch.arange(start, start + question.shape[1])[None]).logits[:, -1].float()
    return out, time.perf_counter() - t0


def child(args) -> int:
    """The new process: load the model, then the saved cache, and ask the three questions."""
    from qcache import QuantCache
    from qcache.tools.models import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    _, questions = _tokens(tok, args.context)
    reference = torch.load(args.reference)
    t0 = time.perf_counter()
    loaded = QuantCache.load(args.load, model)
    load_s = time.perf_counter() - t0
    rows = []
    for i, q in enumerate(questions):
        t1 = time.perf_counter()
        cache = loaded.fork()
        fork_s = time.perf_counter() - t1
        logits, ask_s = _ask(model, cache, q, args.context)
        rows.append({"question": i, "fork_s": fork_s, "ask_s": ask_s,
                     "ttft_s": ask_s + fork_s + (load_s if i == 0 else 0.0),
                     "identical_to_fresh": bool(torch.equal(logits, reference[i]))})
    print(json.dumps({"load_s": load_s, "questions": rows}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    p.add_argument("--load", help=argparse.SUPPRESS)
    p.add_argument("--reference", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.load:
        return child(args)

    from safetensors.torch import save_file
    from transformers import DynamicCache

    from eval.provenance import git_state, load_average
    from qcache import QuantCache, __version__
    from qcache.tools.models import load_model

    torch.set_num_threads(args.threads)
    command = "python bench/prefix_reuse.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load_before = load_average()
    model, tok = load_model(args.model, dtype=getattr(torch, args.dtype))
    doc, questions = _tokens(tok, args.context)
    N = doc.shape[1]

    cache = QuantCache(bits=4)
    t0 = time.perf_counter()
    with torch.no_grad():
        model(doc, cache=cache, use_cache=True)
    prefill_s = time.perf_counter() - t0
    fresh = []
    for q in questions:
        logits, ask_s = _ask(model, cache.fork(), q, N)
        fresh.append((logits, ask_s))
    work = Path(tempfile.mkdtemp(prefix="prefix-reuse-"))
    path = work / "prefix.safetensors"
    t0 = time.perf_counter()
    cache.save(path)
    save_s = time.perf_counter() - t0
    reference = work / "reference.pt"
    torch.save([logits for logits, _ in fresh], reference)

    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(doc, cache=dynamic, use_cache=True)
    values = sum(layer.keys.numel() + layer.values.numel() for layer in dynamic.layers)  # K and V values at N tokens
    dyn_path = work / "dynamic.safetensors"
    save_file({f"layers.{i}.{n}": getattr(layer, n).contiguous() for i, layer in enumerate(dynamic.layers)
               for n in ("keys", "values")}, str(dyn_path))
    del dynamic

    child_cmd = [sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--context", str(N),
                 "--dtype", args.dtype, "--threads", str(args.threads), "--load", str(path),
                 "--reference", str(reference)]
    done = subprocess.run(child_cmd, capture_output=True, text=True, env=os.environ | {"TQDM_DISABLE": "1"})
    if done.returncode:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"the loading process failed (exit {done.returncode})")
    loaded = json.loads(done.stdout.strip().splitlines()[-1])

    mem = cache.memory()
    report = {
        "command": command, "model": args.model, "context": N, "dtype": args.dtype, "threads": args.threads,
        "question_tokens": QUESTION_TOKENS, "git": git_state(), "qcache": __version__,
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load_average": [load_before, load_average()],
        "fresh": {"prefill_s": prefill_s, "ask_s": [s for _, s in fresh], "ttft_s": prefill_s + fresh[0][1]},
        "saved": {"save_s": save_s, "file_bytes": path.stat().st_size, "held_bytes": mem.total - mem.reserved,
                  "bits_per_value_held": 8 * (mem.total - mem.reserved) / values,
                  "dynamic_file_bytes": dyn_path.stat().st_size},
        "loaded": loaded,
    }
    for f in work.iterdir():
        f.unlink()
    work.rmdir()
    print(json.dumps(report, indent=1))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(f"{out}.json").write_text(json.dumps(report, indent=1) + "\n")
        Path(f"{out}.md").write_text(render(report))
    return 0


def render(r: dict) -> str:
    git = r["git"] or {"commit": "unknown", "dirty": True}
    s, f, ld = r["saved"], r["fresh"], r["loaded"]
    mib = 2**20
    lines = [
        f"# Prefix reuse: {r['model']}, a {r['context']}-token document asked three questions", "",
        f"Command: `{r['command']}`  ", f"git {git['commit'][:10]}{' (uncommitted changes)' if git['dirty'] else ''}; "
        f"qcache {r['qcache']}, torch {r['versions']['torch']}, transformers {r['versions']['transformers']}; "
        f"{r['machine']}, {r['threads']} torch threads, weights {r['dtype']}; load average {r['load_average'][0]} "
        f"before, {r['load_average'][1]} after.", "",
        f"`QuantCache(bits=4)`, defaults: {s['bits_per_value_held']:.2f} bits/value held at {r['context']} tokens (every "
        f"tensor it holds, less unused capacity, over DynamicCache's K and V values). A question is "
        f"{r['question_tokens']} tokens; time to first token (TTFT) is "
        "the seconds from having the model loaded to the logits of the question's last token. The loaded cache is "
        "read in a new Python process (`QuantCache.load`, then `fork()` per question).", "",
        "| | seconds | |", "|---|---:|---|",
        f"| fresh: prefill the document | {f['prefill_s']:.2f} | |",
        f"| fresh: TTFT of question 1 (prefill + question) | {f['ttft_s']:.2f} | |",
        f"| save | {s['save_s']:.3f} | |",
        f"| loaded: `QuantCache.load` | {ld['load_s']:.3f} | |",
    ]
    for q in ld["questions"]:
        lines.append(f"| loaded: TTFT of question {q['question'] + 1} (fork + question{' + load' if not q['question'] else ''}) "
                     f"| {q['ttft_s']:.3f} | logits {'identical to' if q['identical_to_fresh'] else 'DIFFER from'} "
                     "the fresh cache's |")
    lines += [
        "", f"Speed-up of the first answer: {f['ttft_s'] / ld['questions'][0]['ttft_s']:.0f}x.", "",
        "| file | bytes | MiB |", "|---|---:|---:|",
        f"| QuantCache.save | {s['file_bytes']:,} | {s['file_bytes'] / mib:.1f} |",
        f"| DynamicCache keys and values, safetensors | {s['dynamic_file_bytes']:,} | "
        f"{s['dynamic_file_bytes'] / mib:.1f} |",
        f"| (QuantCache held in memory, less unused capacity) | {s['held_bytes']:,} | {s['held_bytes'] / mib:.1f} |",
        "", f"The file is {s['file_bytes'] / s['dynamic_file_bytes']:.3f} of DynamicCache's.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
