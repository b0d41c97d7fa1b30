"""Datasets and scoring of the project's lm-eval tasks, built locally at run time (nothing is downloaded).

    task             output type             data
    ---------------  ----------------------  -----------------------------------------------------------------
    qcache_ppl       loglikelihood_rolling   qcache.tools.data's "eval" split (never used by calibration), cut at
                                             paragraph ends into documents of about `ppl_doc_chars` characters
    qcache_passkey   generate_until          "The pass key is NNNNN. Remember it." hidden at a random depth in
                                             filler text, sized with the model's tokenizer to each length

lm-eval calls the dataset functions with the task metadata: `--metadata` JSON merged over `--model_args`.
Keys read here (all optional):

    ppl_doc_chars       characters per perplexity document (default 8000, about 1.6k SmolLM2 tokens)
    max_seq_lengths     token lengths of the passkey prompts, as for RULER (default [4096]);
                        `passkey_lengths` overrides it for the passkey task alone
    passkey_samples     samples per length (default 50); rows alternate between lengths, so `--limit` takes
                        the first ones of every length (metrics: exact_match, and exact_match@<length> each)
    seed                sample seed (default 42)
    tokenizer / pretrained  the tokenizer (a short name such as smollm2-135m, a directory or a hub id)
"""

from __future__ import annotations

import functools
import random
import re

import datasets

PPL_DOC_CHARS = 8000
PASSKEY_SAMPLES = 50
PASSKEY_LENGTHS = [4096]
PASSKEY_GEN_RESERVE = 32  # tokens of each length left for the answer (RULER leaves 128)
SEED = 42

_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.")
_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
_QUESTION = "What is the pass key? The pass key is"


# ---------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------


def _tokenizer_name(kwargs: dict) -> str | None:
    for key in ("tokenizer", "pretrained"):
        value = kwargs.get(key)
        if isinstance(value, str) and value:
            return value
    return None


@functools.cache
def _load_tokenizer(name: str):
    from pathlib import Path

    from transformers import AutoTokenizer

    from qcache.tools.models import resolve_model

    path = resolve_model(name)
    local = {"local_files_only": True} if Path(path).is_dir() else {}
    return AutoTokenizer.from_pretrained(path, **local)


def _tokenizer(kwargs: dict, task: str, required: bool):
    name = _tokenizer_name(kwargs)
    if name is None:
        if required:
            raise ValueError(f"{task} sizes its prompts in tokens and needs a tokenizer: pass --model_args "
                             "pretrained=<model> or --metadata '{\"tokenizer\": \"<model>\"}'")
        return None
    return _load_tokenizer(name)


def _test_split(rows: list[dict]) -> dict[str, datasets.Dataset]:
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


# ---------------------------------------------------------------------------------------------------------
# Perplexity
# ---------------------------------------------------------------------------------------------------------


def split_documents(text: str, doc_chars: int) -> list[str]:
    """`text` cut at paragraph ends (blank lines) into documents of at least `doc_chars` characters (the last
    one may be shorter only if it is the whole text)."""
    if doc_chars < 1:
        raise ValueError(f"ppl_doc_chars={doc_chars} must be >= 1")
    docs, current = [], []
    size = 0
    for paragraph in re.split(r"\n\s*\n", text.strip()):
        current.append(paragraph.strip())
        size += len(paragraph)
        if size >= doc_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:  # the remainder joins the last document
        tail = "\n\n".join(current)
        docs[-1:] = [f"{docs[-1]}\n\n{tail}"] if docs else [tail]
    return docs


def eval_text(**kwargs) -> dict[str, datasets.Dataset]:
    """The qcache_ppl documents: the "eval" split of qcache.tools.data, with their token counts when a tokenizer is
    known (for token_perplexity)."""
    from qcache.tools.data import read_split

    doc_chars = int(kwargs.get("ppl_doc_chars") or PPL_DOC_CHARS)
    tokenizer = _tokenizer(kwargs, "qcache_ppl", required=False)
    rows = []
    for i, doc in enumerate(split_documents(read_split("eval"), doc_chars)):
        n = len(tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]) if tokenizer else -1
        rows.append({"index": i, "text": doc, "num_tokens": n})
    return _test_split(rows)


def ppl_results(doc: dict, results: list[float]) -> dict:
    """lm-eval's rolling-loglikelihood metrics, plus token_perplexity when the document's tokens were counted."""
    (loglikelihood,) = results
    text = doc["text"]
    out = {
        "word_perplexity": (loglikelihood, len(re.split(r"\s+", text))),
        "byte_perplexity": (loglikelihood, len(text.encode("utf-8"))),
        "bits_per_byte": (loglikelihood, len(text.encode("utf-8"))),
    }
    if doc.get("num_tokens", -1) > 0:
        out["token_perplexity"] = (loglikelihood, doc["num_tokens"])
    return out


# ---------------------------------------------------------------------------------------------------------
# Passkey
# ---------------------------------------------------------------------------------------------------------


def passkey_prompt(key: int, before: int, after: int) -> str:
    """The prompt with `before` filler sentences groups ahead of the pass key and `after` behind it."""
    parts = [_INTRO, *([_FILLER] * before), _NEEDLE.format(key=key), *([_FILLER] * after), _QUESTION]
    return " ".join(parts)


def passkey_samples(tokenizer, length: int, num_samples: int, seed: int = SEED,
                    reserve: int = PASSKEY_GEN_RESERVE) -> list[dict]:
    """`num_samples` passkey prompts of at most `length - reserve` tokens, the key at a random depth."""
    budget = length - reserve

    def count(text: str) -> int:
        return len(tokenizer(text, verbose=False)["input_ids"])

    base = count(passkey_prompt(12345, 0, 0))
    per_filler = max((count(passkey_prompt(12345, 40, 0)) - base) / 40, 1.0)
    fillers = int((budget - base) / per_filler)
    if fillers < 1:
        raise ValueError(f"passkey length={length} leaves no room for filler text (the prompt alone is {base} "
                         f"tokens, plus {reserve} for the answer)")
    rng = random.Random(f"{seed}-{length}")
    rows = []
    for index in range(num_samples):
        key, depth = rng.randint(10_000, 99_999), rng.random()
        total = fillers
        while True:
            before = round(total * depth)
            prompt = passkey_prompt(key, before, total - before)
            n = count(prompt)
            if n <= budget or total == 0:
                break
            total -= max(1, int((n - budget) / per_filler))
        rows.append({"index": index, "input": prompt, "answer": str(key), "length": length, "prompt_tokens": n,
                     "depth": round(before / max(total, 1), 3)})
    return rows


def passkey(**kwargs) -> dict[str, datasets.Dataset]:
    """The qcache_passkey samples, for every length in `passkey_lengths` (else `max_seq_lengths`)."""
    lengths = kwargs.get("passkey_lengths") or kwargs.get("max_seq_lengths") or PASSKEY_LENGTHS
    num_samples = int(kwargs.get("passkey_samples") or PASSKEY_SAMPLES)
    seed = int(kwargs.get("seed") if kwargs.get("seed") is not None else SEED)
    tokenizer = _tokenizer(kwargs, "qcache_passkey", required=True)
    per_length = [passkey_samples(tokenizer, int(length), num_samples, seed) for length in lengths]
    rows = [row for same_index in zip(*per_length) for row in same_index]  # interleaved: --limit spans lengths
    return _test_split(rows)


def passkey_results(doc: dict, results: list[str]) -> dict:
    """exact_match (the first number in the generation is the pass key), overall and at the doc's length."""
    found = re.search(r"\d+", results[0])
    score = float(found is not None and found.group(0) == doc["answer"])
    return {"exact_match": score, f"exact_match@{doc['length']}": score}  # lm-eval averages the latter too
