"""qcache.tools.data: the offline English splits and the token windows cut from them."""

import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from qcache.tools.data import (
    CALIBRATION_FILES,
    EVAL_FILES,
    SPLITS,
    english_dir,
    read_split,
    sha256_of_split,
    token_sequences,
)


@pytest.fixture(scope="module")
def word_tokenizer():
    """A tiny word-level tokenizer built here (no download): a few words, everything else [UNK]."""
    vocab = {w: i for i, w in enumerate(["[UNK]", "[BOS]", "the", "of", "and", ",", "."])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="[BOS]")


def test_english_dir_found_without_importing_the_package():
    root = english_dir()
    assert (root / "history.txt").is_file()
    assert "dataset_build" not in sys.modules  # its main.py does not import on Python 3.11


def test_splits_are_disjoint_and_cover_the_folder():
    assert set(EVAL_FILES).isdisjoint(CALIBRATION_FILES)
    assert EVAL_FILES == ("history.txt", "philosophy.txt")
    on_disk = {p.name for p in english_dir().glob("*.txt")}
    assert set(EVAL_FILES) | set(CALIBRATION_FILES) == on_disk


@pytest.mark.parametrize("split", list(SPLITS))
def test_read_split_nonempty(split):
    assert len(read_split(split)) > 10_000


def test_split_texts_do_not_overlap():
    eval_text, calibration_text = read_split("eval"), read_split("calibration")
    assert eval_text[:500] not in calibration_text
    assert calibration_text[:500] not in eval_text


def test_read_split_rejects_unknown_split():
    with pytest.raises(ValueError, match=r"split='train'.*'eval'.*'calibration'"):
        read_split("train")


def test_sha256_of_split_stable_and_distinct():
    assert sha256_of_split("eval") == sha256_of_split("eval")
    assert sha256_of_split("eval") != sha256_of_split("calibration")
    assert len(sha256_of_split("calibration")) == 64


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("num_sequences, seq_len", [(1, 16), (4, 128)])
def test_token_sequences_are_consecutive_windows(word_tokenizer, split, num_sequences, seq_len):
    seqs = token_sequences(word_tokenizer, split, num_sequences, seq_len)
    assert seqs.shape == (num_sequences, seq_len)
    assert seqs.dtype == torch.long
    ids = word_tokenizer(read_split(split), add_special_tokens=False)["input_ids"]
    assert torch.equal(seqs.flatten(), torch.tensor(ids[: num_sequences * seq_len]))


def test_token_sequences_without_special_tokens(word_tokenizer):
    seqs = token_sequences(word_tokenizer, "eval", 2, 32)
    assert word_tokenizer.bos_token_id not in seqs.tolist()[0]


def test_token_sequences_too_short(word_tokenizer):
    with pytest.raises(ValueError, match=r"has \d+ tokens.*needs 1000000000"):
        token_sequences(word_tokenizer, "eval", 1000, 1_000_000)


@pytest.mark.parametrize("num_sequences, seq_len", [(0, 16), (2, -1), (2, 1.5)])
def test_token_sequences_rejects_bad_sizes(word_tokenizer, num_sequences, seq_len):
    with pytest.raises(ValueError, match="must be a positive integer"):
        token_sequences(word_tokenizer, "eval", num_sequences, seq_len)


def test_code_split_is_the_interpreters_own_python_sources(word_tokenizer):
    """The "code" split: the standard library's files in CODE_FILES order (calibration reads only CALIBRATION_FILES),
    long enough for two 32k-token documents of a code model's tokenizer (~280k Qwen2.5 tokens; here a rough
    count of words)."""
    import sysconfig
    from pathlib import Path

    from qcache.tools.data import CODE_FILES

    text = read_split("code")
    root = Path(sysconfig.get_paths()["stdlib"])
    first = (root / CODE_FILES[0]).read_text(encoding="utf-8").strip()
    assert text.startswith(first) and "def " in text and "class " in text
    assert len(text.split()) > 2 * 32768
    assert set(CODE_FILES).isdisjoint(CALIBRATION_FILES)
    assert token_sequences(word_tokenizer, "code", 2, 64).shape == (2, 64)
    assert sha256_of_split("code") != sha256_of_split("eval")
