"""Key-value needles in one long haystack, scored teacher-forced through a cache filled once.

    haystack   eval-split text (the tokenizer's own leading special tokens first, e.g. Gemma's <bos>), with
               `count` needles " The secret number of {key} is {key} {value}." inserted after sentence ends, at
               depths spread evenly from 5 % to 95 % of the filled context
    question   "\nQuestion: What is the secret number of {key}?\nAnswer: The secret number of {key} is {key}"
    answer     " {value}": five random digits (or, with values="word", a noun): the tokens scored

Keys are single words, absent from the haystack text, no two starting with the same token. The value follows its
key directly, in the needle and after the question, so the model finds it by matching the key: with the value
right after "is", the token before it is the same in every needle, and a 135M model found far fewer of 30 needles.

A cache is filled with the haystack once (`fill_cache`, chunked like every other measurement), then every needle's
question + answer runs through its own copy of the filled cache (`fork_cache`) and the answer
tokens are scored from the logits (teacher forcing, no generation):

    logprob      sum of log p(answer token) over the answer: the continuous needle margin
    min_margin   min over answer tokens of log p(answer token) - max log p(any other token): > 0 iff every answer
                 token is the argmax
    found        every answer token is the argmax

Why a copy and not `cache.crop`: rolling back must restore exactly the filled state, and `crop` does not for
several caches: QuantCache moves haystack tokens from its full-precision residual into codes when the question
fills a block, and cropping the question leaves them quantized; Transformers' quantized caches re-quantize their
whole cache when their residual fills; sliding-window layers cannot be cropped once their window is full. A deep
copy is exact for every cache and costs one memory copy of the cache per needle.

Example:
    >>> fill_ids, needles = build_needles(tokenizer, read_split("eval"), length=4096, count=30)  # doctest: +SKIP
    >>> cache = fill_cache(model, build_cache("quant", model.config, 4), fill_ids)               # doctest: +SKIP
    >>> scores = score_needles(model, cache, needles)                                            # doctest: +SKIP
"""

from __future__ import annotations

import copy
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from qcache.tools.footprint import tensors_reachable

__all__ = [
    "Needle",
    "NeedleScore",
    "needle_text",
    "question_text",
    "build_needles",
    "fill_cache",
    "fork_cache",
    "score_suffix",
    "score_needles",
    "wilson_interval",
    "depth_third",
]

logger = logging.getLogger(__name__)

# keys: one word each, no two sharing a first token, none sharing a token-level prefix with a value list entry
_KEYS = ("zephyr", "quasar", "nebula", "tundra", "lagoon", "geyser", "fjord", "savanna", "volcano", "monsoon",
         "meteor", "aurora", "prairie", "oasis", "cyclone", "blizzard", "comet", "crater", "plateau", "estuary",
         "tornado", "avalanche", "icicle", "boulder", "quartz", "obsidian", "granite", "saffron", "magenta",
         "turquoise", "vermilion", "chartreuse", "lavender", "mahogany", "sparrow", "heron", "condor", "osprey",
         "kestrel", "albatross", "puffin", "toucan", "hummingbird", "nightingale", "woodpecker", "cormorant",
         "sandpiper", "lantern", "compass", "anchor", "beacon", "mirror", "thistle", "orchard", "meadow", "harbor",
         "windmill", "lighthouse", "chimney", "pagoda", "citadel", "obelisk", "aqueduct", "minaret")
# word values: the first token of each needle's answer differs from every other needle's, so once the key has been
# found the rest of the answer is a plain copy; numbers make every digit a choice among needles
_WORDS = ("pineapple", "violin", "umbrella", "saxophone", "kangaroo", "avocado", "trombone", "cactus", "pelican",
          "marmalade", "harmonica", "penguin", "broccoli", "tambourine", "flamingo", "lollipop", "submarine",
          "zucchini", "accordion", "platypus", "cinnamon", "xylophone", "walrus", "trampoline", "mandolin",
          "porcupine", "cauliflower", "hedgehog", "toboggan", "octopus", "artichoke", "chameleon", "tangerine",
          "bagpipe", "armadillo", "raspberry", "microscope", "giraffe", "pretzel", "telescope", "rhinoceros",
          "asparagus", "caterpillar", "ukulele", "mongoose", "parsnip", "harpsichord", "iguana", "gazebo", "nectarine",
          "snorkel", "lobster", "peppermint", "catapult", "dolphin", "spatula", "meerkat", "clarinet", "coconut",
          "scarecrow", "bulldozer", "jellyfish", "wombat", "kayak")
VALUE_DIGITS = 5
VALUE_KINDS = ("number", "word")
_SNAP_TOKENS = 64  # a needle goes after the first sentence end within this many tokens of its depth


def needle_text(key: str, value: str, kind: str = "number") -> str:
    """The sentence inserted into the haystack (after a sentence end, hence the leading space)."""
    return f" The secret {kind} of {key} is {key} {value}."


def question_text(key: str, kind: str = "number") -> str:
    """The question fed after the haystack; the answer " {value}" follows it."""
    return f"\nQuestion: What is the secret {kind} of {key}?\nAnswer: The secret {kind} of {key} is {key}"


def _draw_words(tokenizer, pool: Sequence[str], count: int, rng: random.Random, text: str, what: str) -> list[str]:
    """`count` words of `pool`, in random order, absent from `text`, no two starting with the same token (the first
    one that is not only white space)."""
    words, firsts, lowered = [], set(), text.lower()
    for word in rng.sample(list(pool), len(pool)):
        ids = _ids(tokenizer, f" {word}")
        first = next((i for i in ids if tokenizer.decode([i]).strip()), ids[0])  # a lone space token is no start
        if word not in lowered and first not in firsts:
            words.append(word)
            firsts.add(first)
        if len(words) == count:
            return words
    raise ValueError(f"count={count} needles, but only {len(words)} {what} are absent from the text and start with "
                     "distinct tokens with this tokenizer; use fewer needles")


def _draw_values(tokenizer, kind: str, count: int, rng: random.Random, text: str) -> list[str]:
    """`count` distinct values: words (see `_draw_words`) or 5-digit numbers."""
    if kind == "number":
        return [str(v) for v in rng.sample(range(10 ** (VALUE_DIGITS - 1), 10 ** VALUE_DIGITS), count)]
    return _draw_words(tokenizer, _WORDS, count, rng, text, "word values")


@dataclass(frozen=True)
class Needle:
    """One needle of a haystack.

    Args:
        key: the name asked about ("zephyr").
        value: the answer ("48213").
        depth: where the needle starts, as a fraction of the filled context (0 = first token).
        position: token index of the needle's first token in the filled context.
        question_ids: the question's tokens, fed after the context.
        answer_ids: the answer's tokens (teacher-forced and scored).

    Example:
        >>> Needle("zephyr", "48213", 0.5, 2000, (10, 11), (12, 13)).suffix_ids
        (10, 11, 12, 13)
    """

    key: str
    value: str
    depth: float
    position: int
    question_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]

    @property
    def suffix_ids(self) -> tuple[int, ...]:
        """Question then answer: what runs through the filled cache."""
        return self.question_ids + self.answer_ids


@dataclass(frozen=True)
class NeedleScore:
    """The answer's teacher-forced score through one cache (see the module docstring)."""

    key: str
    depth: float
    logprob: float
    min_margin: float
    found: bool


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _sentence_ends(tokenizer, ids: Sequence[int]) -> list[bool]:
    """Whether each token ends with a full stop (a needle may follow it)."""
    return [str(t).endswith(".") for t in tokenizer.convert_ids_to_tokens(list(ids))]


def build_needles(tokenizer, text: str, length: int, count: int, seed: int = 0, first_depth: float = 0.05,
                  last_depth: float = 0.95, align: int = 1, values: str = "number"
                  ) -> tuple[torch.LongTensor, list[Needle]]:
    """The filled context (haystack with `count` needles) and its needles, for contexts of at most `length` tokens.

    The filled context holds `length - longest question + answer` tokens rounded down to a multiple of `align`, so
    every needle's context + question + answer fits in `length`. Keys and values are drawn with
    `random.Random(seed)`; the haystack is `text` from its start, after the tokenizer's own leading special tokens
    (what `tokenizer(text)` puts first, e.g. <bos>).

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the haystack text (the eval split); keys that occur in it are never used.
        length: the longest context + question + answer, in tokens.
        count: needles (>= 1); depths spread evenly from `first_depth` to `last_depth`.
        seed: seed of the keys and values.
        align: the filled context's length is a multiple of this (`eval.fidelity.needle_align`: Transformers'
            quantized caches then hold no residual after the fill, and a question never makes them re-quantize).
        values: "number" (5 random digits) or "word" (a noun, absent from `text`, whose first token no other
            needle's answer starts with).

    Returns:
        (LongTensor [1, F] of the filled context, needles in depth order).

    Example:
        >>> ids, needles = build_needles(tokenizer, read_split("eval"), 2048, 30)  # doctest: +SKIP
        >>> ids.shape[1] + max(len(n.suffix_ids) for n in needles) <= 2048       # doctest: +SKIP
        True
    """
    for name, value in (("length", length), ("count", count), ("align", align)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if values not in VALUE_KINDS:
        raise ValueError(f"values={values!r} is not supported; allowed values: {list(VALUE_KINDS)}")
    if not 0.0 <= first_depth <= last_depth <= 1.0:
        raise ValueError(f"depths must satisfy 0 <= first_depth <= last_depth <= 1; got {first_depth}, {last_depth}")
    rng = random.Random(seed)
    keys = _draw_words(tokenizer, _KEYS, count, rng, text, "keys")
    kind, values = values, _draw_values(tokenizer, values, count, rng, text)
    needle_ids = [_ids(tokenizer, needle_text(k, v, kind)) for k, v in zip(keys, values, strict=True)]
    questions = [tuple(_ids(tokenizer, question_text(k, kind))) for k in keys]
    answers = [tuple(_ids(tokenizer, f" {v}")) for v in values]
    prefix = list(tokenizer("", add_special_tokens=True)["input_ids"])  # e.g. [<bos>] for Gemma, [] for SmolLM2
    fill_len = (length - max(len(q) + len(a) for q, a in zip(questions, answers, strict=True))) // align * align
    hay_len = fill_len - len(prefix) - sum(len(n) for n in needle_ids)
    if hay_len < count:
        raise ValueError(f"length={length} is too short for {count} needles (they alone need "
                         f"{length - hay_len + count} tokens)")
    text_ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if len(text_ids) < hay_len:
        raise ValueError(f"the haystack text has {len(text_ids)} tokens; length={length} needs {hay_len}")
    haystack = text_ids[:hay_len]
    ends = _sentence_ends(tokenizer, haystack)
    depths = [first_depth + (last_depth - first_depth) * i / max(count - 1, 1) for i in range(count)]
    cuts = []
    for d in depths:  # cut after the first sentence end at or past the target, if one is near
        target = min(round(d * hay_len), hay_len)
        end = next((i + 1 for i in range(max(target - 1, 0), min(target - 1 + _SNAP_TOKENS, hay_len)) if ends[i]),
                   target)
        cuts.append(max(end, cuts[-1] if cuts else 0))
    filled, needles, prev = list(prefix), [], 0
    for cut, key, value, ids, q, a in zip(cuts, keys, values, needle_ids, questions, answers,
                                                 strict=True):
        filled += haystack[prev:cut]
        needles.append(Needle(key, value, len(filled) / fill_len, len(filled), q, a))
        filled += ids
        prev = cut
    filled += haystack[prev:]
    if len(filled) != fill_len:  # pragma: no cover - a bug here, not bad input
        raise RuntimeError(f"built {len(filled)} context tokens, expected {fill_len}")
    return torch.tensor([filled], dtype=torch.long), needles  # [1, F]


@torch.no_grad()
def fill_cache(model, cache, ids: torch.Tensor, chunk: int = 256):
    """Feed `ids` [1, F] through `cache` in chunks (`eval.options.chunk_bounds`: `chunk` tokens, a last partial
    piece cut at a multiple of 8); only the last position's logits are computed. Returns the cache."""
    from qcache.tools.data import chunk_bounds

    device = next(model.parameters()).device
    for start, end in chunk_bounds(ids.shape[1], chunk):
        model(ids[:, start:end].to(device), cache=cache, use_cache=True, logits_to_keep=1)
    return cache


def _subclass_tensors(obj) -> dict[int, torch.Tensor]:
    """{id: tensor} of the tensor-subclass instances reachable from `obj` (quanto's and torchao's quantized tensors)."""
    return {id(t): t for t in tensors_reachable(obj)
            if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)}


def fork_cache(cache):
    """An independent copy of a filled cache: what a needle's question runs through.

    Plain tensors are copied (`copy.deepcopy`). Tensor subclasses are shared: quanto's quantized tensors cannot be
    deep-copied, and Transformers' quantized caches, which hold them, replace them when they re-quantize and never
    write into them; with the filled context aligned (`build_needles(align=...)`) a question
    shorter than 128 tokens does not even make them re-quantize (`eval.fidelity.needle_align`).
    """
    memo = dict(_subclass_tensors(cache))  # deepcopy returns memo[id(x)] for these: shared, not copied
    return copy.deepcopy(cache, memo)


def score_suffix(logits: torch.Tensor, answer_ids: Sequence[int]) -> tuple[float, float, bool]:
    """(logprob, min_margin, found) of the answer from the logits of the answer's positions.

    Args:
        logits: [A, V], row i predicting answer token i (the logits at the positions just before each).
        answer_ids: the A answer tokens.

    Example:
        >>> score_suffix(torch.tensor([[0.0, 2.0], [1.0, 0.0]]), [1, 0])[2]
        True
    """
    if logits.shape[0] != len(answer_ids):
        raise ValueError(f"logits has {logits.shape[0]} rows for {len(answer_ids)} answer tokens")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [A, V]
    target = torch.as_tensor(list(answer_ids), device=logp.device)
    chosen = logp.gather(1, target[:, None])[:, 0]  # [A]
    others = logp.scatter(1, target[:, None], float("-inf")).amax(dim=-1)  # [A]
    margin = chosen - others
    return float(chosen.sum()), float(margin.min()), bool((margin > 0).all())


@torch.no_grad()
def score_needles(model, filled_cache, needles: Sequence[Needle], progress: bool = False,
                  desc: str | None = None) -> list[NeedleScore]:
    """Each needle's question + answer through its own copy of `filled_cache` (left unchanged), scored."""
    device = next(model.parameters()).device
    scores = []
    for needle in tqdm(needles, desc=desc or "needles", disable=not progress, leave=False):
        suffix = torch.tensor([needle.suffix_ids], dtype=torch.long, device=device)  # [1, Q + A]
        n_answer = len(needle.answer_ids)
        # the last answer token predicts nothing we score: logits of the Q + A - 1 ... positions before each answer
        out = model(suffix[:, :-1], cache=fork_cache(filled_cache), use_cache=True,
                    logits_to_keep=n_answer)
        logprob, margin, found = score_suffix(out.logits[0], needle.answer_ids)
        scores.append(NeedleScore(needle.key, needle.depth, logprob, margin, found))
    return scores


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial share (95 % by default).

    Example:
        >>> [round(x, 3) for x in wilson_interval(30, 30)]
        [0.886, 1.0]
    """
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1; got {successes}/{trials}")
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def depth_third(depth: float) -> int:
    """0, 1 or 2: the third of the context a needle sits in."""
    return min(int(depth * 3), 2)
