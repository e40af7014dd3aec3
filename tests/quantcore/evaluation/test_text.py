"""Calibration text: packaged defaults, .txt / .jsonl / .cor loading, deterministic token windows."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

from quantcore.evaluation import text
from quantcore.evaluation.text import (
    ShortTextWarning,
    default_calibration_text,
    default_eval_text,
    load_documents,
    prefix_ids,
    token_batches,
)
from tests.factories import tiny_tokenizer

BOS_ID = 1
EOS_ID = 2


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


# --- packaged text -------------------------------------------------------------------------------


def test_default_texts_are_the_lee_corpora():
    calibration, evaluation = default_calibration_text(), default_eval_text()
    assert calibration.name == "lee_background.cor" and evaluation.name == "lee.cor"
    assert len(load_documents(calibration)) == 300
    assert len(load_documents(evaluation)) == 50


def test_missing_gensim_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(text.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps gensim"):
        default_calibration_text()


def test_gensim_is_located_not_imported():
    assert importlib.util.find_spec("gensim") is not None
    default_calibration_text()
    import sys

    assert "gensim" not in sys.modules


# --- loading -------------------------------------------------------------------------------------


def test_txt_paragraphs_split_on_blank_lines_and_joined(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("First paragraph,\nwrapped here.\n\n  \nSecond one.\n\n\n", encoding="utf-8")
    assert load_documents(path) == ["First paragraph, wrapped here.", "Second one."]


def test_txt_without_blank_lines_is_one_document_per_line(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("one\r\ntwo\r\n\r\nthree", encoding="utf-8")  # \r\n\r\n is a blank line
    assert load_documents(path) == ["one two", "three"]
    path.write_text("alpha\nbeta\ngamma\n", encoding="utf-8")
    assert load_documents(path) == ["alpha", "beta", "gamma"]


def test_txt_encodings(tmp_path):
    path = tmp_path / "enc.txt"
    path.write_bytes("\ufeffcafé naïve".encode())
    assert load_documents(path) == ["café naïve"]
    path.write_bytes("café".encode("latin-1"))  # not valid UTF-8: latin-1 fallback
    assert load_documents(path) == ["café"]


def test_cor_is_one_latin1_document_per_line(tmp_path):
    path = tmp_path / "x.cor"
    path.write_bytes("Zürich news\n\nsecond story\n".encode("latin-1"))
    assert load_documents(path) == ["Zürich news", "second story"]


def test_jsonl_reads_the_text_field(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"text": "one", "id": 1}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    assert load_documents(path) == ["one", "two"]


@pytest.mark.parametrize("bad_line, message", [
    ('{"text": "ok"', "line 2 is not valid JSON"),
    ('{"body": "no text key"}', 'line 2 has no "text" string'),
    ('["a list"]', 'line 2 has no "text" string'),
    ('{"text": 5}', 'line 2 has no "text" string'),
])
def test_jsonl_errors_name_the_line(tmp_path, bad_line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=message):
        load_documents(path)


def test_empty_text_is_refused(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("  \n\n \n")
    with pytest.raises(ValueError, match="holds no text"):
        load_documents(path)


def test_other_suffixes_are_refused(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"\.txt, \.cor, \.jsonl"):
        load_documents(path)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_documents(tmp_path / "nope.txt")


# --- token windows -------------------------------------------------------------------------------


def test_windows_are_consecutive_cuts_of_the_joined_documents(tokenizer):
    documents = ["the news of the year", "it was said", "this is a year"]
    ids = token_batches(tokenizer, documents, n_samples=2, seq_len=6)
    stream = []
    for document in documents:
        if stream:
            stream.append(EOS_ID)
        stream.extend(tokenizer(document, add_special_tokens=False).input_ids)
    assert ids.dtype == torch.long and ids.shape == (2, 6)
    assert ids.flatten().tolist() == stream[:12]
    assert ids[0, 5].item() == EOS_ID  # the separator between the first two documents


def test_windows_are_deterministic(tokenizer):
    documents = load_documents(default_eval_text())
    first = token_batches(tokenizer, documents, n_samples=4, seq_len=32)
    second = token_batches(tokenizer, documents, n_samples=4, seq_len=32)
    assert torch.equal(first, second)


def test_short_text_gives_fewer_windows_and_says_so(tokenizer):
    documents = ["the a of to and in is it that was"]  # 10 tokens
    with pytest.warns(ShortTextWarning, match="3 windows of 3 tokens instead of the 5"):
        ids = token_batches(tokenizer, documents, n_samples=5, seq_len=3)
    assert ids.shape == (3, 3)


def test_enough_text_gives_no_warning(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert token_batches(tokenizer, ["the a of to"], n_samples=2, seq_len=2).shape == (2, 2)


def test_text_shorter_than_one_window_is_refused(tokenizer):
    with pytest.raises(ValueError, match="only 4 tokens, fewer than one window of 16"):
        token_batches(tokenizer, ["the a of to"], n_samples=1, seq_len=16)


@pytest.mark.parametrize("n_samples, seq_len", [(0, 8), (2, 0)])
def test_window_sizes_must_be_positive(tokenizer, n_samples, seq_len):
    with pytest.raises(ValueError, match="at least 1"):
        token_batches(tokenizer, ["the a of"], n_samples=n_samples, seq_len=seq_len)


def test_only_the_needed_documents_are_tokenized(tokenizer):
    class Counting:
        """The tiny tokenizer, counting how many documents it was asked to encode."""

        eos_token_id = EOS_ID

        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, document, **kwargs):
            self.calls += kwargs.get("add_special_tokens") is False and document != "the"  # not prefix_ids' probe
            return tokenizer(document, **kwargs)

    counting = Counting()
    token_batches(counting, ["the a of to and"] * 100, n_samples=1, seq_len=8)
    assert counting.calls == 2


def test_lee_background_fills_many_windows(tokenizer, tmp_path: Path):
    ids = token_batches(tokenizer, load_documents(default_calibration_text()), n_samples=64, seq_len=128)
    assert ids.shape == (64, 128)


def bos_tokenizer(*, cls_sep: bool = False):
    """The tiny tokenizer with a post-processor that adds <s> before every text (as Gemma's, Llama 3's
    do), or BERT-style <s> ... </s> around it."""
    from tokenizers import processors

    tok = tiny_tokenizer()
    single = "<s> $A </s>" if cls_sep else "<s> $A"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)])
    return tok


def test_windows_start_with_the_tokenizers_own_leading_tokens(tokenizer):
    """Each window begins as a served request does (BOS where the tokenizer adds one), and the text
    continues across windows without losing a token."""
    documents = ["the news of the year", "it was said", "this is a year"]
    assert prefix_ids(tokenizer) == []  # no post-processor: nothing is added
    plain = token_batches(tokenizer, documents, n_samples=2, seq_len=6)
    for tok in (bos_tokenizer(), bos_tokenizer(cls_sep=True)):
        assert tok("the year").input_ids[0] == BOS_ID
        assert prefix_ids(tok) == [BOS_ID]  # a trailing </s> is not a prefix
        ids = token_batches(tok, documents, n_samples=2, seq_len=6)
        assert ids.shape == (2, 6) and ids[:, 0].tolist() == [BOS_ID, BOS_ID]
        assert ids[:, 1:].flatten().tolist() == plain.flatten().tolist()[:10]  # the same stream, 5 per window
    with pytest.raises(ValueError, match="no room for text after the tokenizer's 1 leading special token"):
        token_batches(bos_tokenizer(), documents, n_samples=1, seq_len=1)
    with pytest.raises(ValueError, match="fewer than one window of 15 after 1 leading special token"):
        token_batches(bos_tokenizer(), ["the a of to"], n_samples=1, seq_len=16)


def test_load_documents_refuses_what_is_not_text(tmp_path):
    """A binary file (or UTF-16 text) renamed .txt would be read as latin-1 noise and calibrate on garbage."""
    import random

    rng = random.Random(0)
    binary = tmp_path / "weights.txt"
    binary.write_bytes(bytes(rng.randrange(256) for _ in range(4096)))
    with pytest.raises(ValueError, match="NUL bytes"):
        load_documents(binary)
    utf16 = tmp_path / "notes.jsonl"
    utf16.write_text('{"text": "hello"}\n', encoding="utf-16")
    with pytest.raises(ValueError, match="UTF-16"):
        load_documents(utf16)
    noisy = tmp_path / "noisy.cor"  # no NUL, but 1 character in 20 is a control character
    noisy.write_bytes(bytes(0x1b if i % 20 == 0 else 97 for i in range(3000)))  # ESC
    with pytest.raises(ValueError, match="5% of its characters are control characters"):
        load_documents(noisy)
    # text with tabs, Windows line ends and the odd form feed stays text
    fine = tmp_path / "fine.txt"
    fine.write_bytes(b"col1\tcol2\r\n" * 200 + b"\x0cnext page\r\n")
    assert load_documents(fine)
