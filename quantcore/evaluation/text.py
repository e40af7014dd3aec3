"""Calibration and evaluation text: the packaged defaults, user uploads, token windows.

Importing this module never imports torch (the app lists and validates text
uploads); :func:`token_batches` imports it when called.

Text sources:

- the default calibration text is gensim's ``lee_background.cor`` (300 news
  articles, one per line) and the default evaluation text its ``lee.cor`` (50
  other articles); gensim is installed ``--no-deps`` and only located, never
  imported (its ``__init__`` pulls scipy and compiled extensions);
- a user brings ``.txt`` (paragraphs split on blank lines, or lines when the
  file has no blank lines) or ``.jsonl`` (one JSON object per line with a
  ``"text"`` string).
"""

from __future__ import annotations

import importlib.util
import json
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

GENSIM_PACKAGE = "gensim"
GENSIM_TEST_DATA = ("test", "test_data")  # path of the corpora inside the gensim package
CALIBRATION_CORPUS = "lee_background.cor"  # 300 news articles, ~360 KB
EVAL_CORPUS = "lee.cor"  # 50 other articles, ~24 KB
GENSIM_INSTALL_HINT = "pip install --no-deps gensim"
COR_ENCODING = "latin-1"  # the Lee corpora are latin-1, not UTF-8

TEXT_SUFFIXES = (".txt", ".cor", ".jsonl")
JSONL_TEXT_KEY = "text"
MAX_CONTROL_SHARE = 0.01  # more control characters than this (tab and newlines aside): not text
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")  # Unicode category Cc but \t \n \r
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


class ShortTextWarning(UserWarning):
    """The text held fewer token windows than were asked for; the batch is smaller."""


def _gensim_corpus(name: str) -> Path:
    """Path of one of gensim's packaged test corpora, located without importing gensim."""
    spec = importlib.util.find_spec(GENSIM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default text {name!r} ships with the gensim package, which is not installed: "
            f"run `{GENSIM_INSTALL_HINT}`, or upload your own .txt / .jsonl text"
        )
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*GENSIM_TEST_DATA, name)
    if not path.is_file():
        raise ValueError(
            f"gensim is installed but {path} is missing; reinstall it with `{GENSIM_INSTALL_HINT}`"
        )
    return path


def default_calibration_text() -> Path:
    """gensim's ``lee_background.cor``: 300 news articles, the default calibration text."""
    return _gensim_corpus(CALIBRATION_CORPUS)


def default_eval_text() -> Path:
    """gensim's ``lee.cor``: 50 news articles (disjoint from the calibration text)."""
    return _gensim_corpus(EVAL_CORPUS)


def _read_text(path: Path) -> str:
    """A text file as str: UTF-8 (a BOM is dropped), falling back to latin-1, which never fails."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def _split_paragraphs(text: str) -> list[str]:
    """Paragraphs split on blank lines, each joined onto one line; lines when there is no blank line."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    if _BLANK_LINE.search(text):
        blocks = _BLANK_LINE.split(text)
        return [" ".join(line.strip() for line in block.splitlines() if line.strip()) for block in blocks]
    return [line.strip() for line in text.splitlines()]


def _jsonl_documents(path: Path) -> list[str]:
    """The ``"text"`` of each JSON object line; an error names the first bad line."""
    documents = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path.name} line {number} is not valid JSON ({exc.msg}): "
                             f'each line must be an object like {{"{JSONL_TEXT_KEY}": "..."}}') from exc
        if not isinstance(record, dict) or not isinstance(record.get(JSONL_TEXT_KEY), str):
            raise ValueError(f'{path.name} line {number} has no "{JSONL_TEXT_KEY}" string: '
                             f'each line must be an object like {{"{JSONL_TEXT_KEY}": "..."}}')
        documents.append(record[JSONL_TEXT_KEY])
    return documents


def load_documents(path: Path) -> list[str]:
    """The documents of a text file, empty ones dropped.

    ``.cor``: one document per line, latin-1.  ``.txt``: UTF-8 (latin-1
    fallback), paragraphs split on blank lines, or one document per line when
    the file has no blank line.  ``.jsonl``: the ``"text"`` of each line's object.
    Raises ValueError for another suffix, a malformed line, or no text at all.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        raise ValueError(f"{path.name}: calibration text must be one of {', '.join(TEXT_SUFFIXES)} "
                         f"(plain text, or JSON lines with a {JSONL_TEXT_KEY!r} field)")
    if not path.is_file():
        raise ValueError(f"text file {path} does not exist")
    _check_not_binary(path)
    if suffix == ".cor":
        documents = path.read_text(encoding=COR_ENCODING).splitlines()
    elif suffix == ".jsonl":
        documents = _jsonl_documents(path)
    else:
        documents = _split_paragraphs(_read_text(path))
    documents = [doc.strip() for doc in documents if doc.strip()]
    if not documents:
        raise ValueError(f"{path.name} holds no text: calibration needs at least one non-empty document")
    chars = sum(len(doc) for doc in documents)
    control = sum(len(_CONTROL.findall(doc)) for doc in documents)
    if control > MAX_CONTROL_SHARE * chars:
        raise ValueError(f"{path.name} does not look like text: {control / chars:.0%} of its characters are control "
                         "characters (a binary file renamed?). Upload plain UTF-8 text, or JSON lines")
    return documents


def _check_not_binary(path: Path) -> None:
    """Refuse a file with NUL bytes: a binary file, or UTF-16 text, which would otherwise be read as latin-1
    garbage and give statistics of noise."""
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            if b"\x00" in chunk:
                raise ValueError(f"{path.name} contains NUL bytes: it is a binary file or UTF-16 text. Upload "
                                 "plain UTF-8 text (.txt), JSON lines (.jsonl) or a .cor corpus")


def _separator_ids(tokenizer: Any) -> list[int]:
    """Token ids placed between documents: eos, else sep, else none."""
    for token_id in (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "sep_token_id", None)):
        if isinstance(token_id, int):
            return [token_id]
    return []


def _token_stream(tokenizer: Any, documents: Iterable[str], needed: int) -> list[int]:
    """Token ids of the documents joined by the separator, stopping once ``needed`` ids are there."""
    separator = _separator_ids(tokenizer)
    stream: list[int] = []
    for document in documents:
        if stream:
            stream.extend(separator)
        stream.extend(tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"])
        if len(stream) >= needed:
            break
    return stream


def prefix_ids(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before any text it encodes: BOS for Gemma, Llama 3 or
    Mistral, [CLS] for BERT, nothing for Qwen2 or SmolLM2.

    Found by encoding a probe with and without special tokens, so it follows the tokenizer's own
    settings (its post-processor, ``add_bos_token``) rather than a list of model families. A served
    request starts with these tokens, and some models depend on them: Gemma-3-270M's perplexity on
    lee.cor is 24 with its BOS and 387 without, and its first-token activations differ.
    """
    probe = "the"
    plain = list(tokenizer(probe, add_special_tokens=False, verbose=False)["input_ids"])
    full = list(tokenizer(probe, add_special_tokens=True, verbose=False)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []  # the probe encodes differently with special tokens: add none rather than guess


def token_batches(tokenizer: Any, documents: Sequence[str], *, n_samples: int, seq_len: int) -> torch.Tensor:
    """``n_samples`` windows of ``seq_len`` tokens: a LongTensor [n, seq_len].

    Deterministic: the documents are tokenized in order (no special tokens), joined by the
    tokenizer's eos (or sep) id, and cut into consecutive non-overlapping pieces, each placed
    after the tokenizer's :func:`prefix_ids` (its BOS, where it has one), so that every window
    starts the way a served request does; the remainder is dropped. Text too short for a
    single window raises ValueError; text for fewer than ``n_samples`` windows returns what
    there is and emits a :class:`ShortTextWarning`.
    """
    import torch

    if n_samples < 1 or seq_len < 1:
        raise ValueError(f"n_samples and seq_len must be at least 1 (got {n_samples} and {seq_len})")
    prefix = prefix_ids(tokenizer)
    body = seq_len - len(prefix)
    if body < 1:
        raise ValueError(f"a window of {seq_len} tokens has no room for text after the tokenizer's "
                         f"{len(prefix)} leading special token(s): choose a longer sequence length")
    stream = _token_stream(tokenizer, documents, n_samples * body)
    windows = min(n_samples, len(stream) // body)
    if windows == 0:
        raise ValueError(f"the text has only {len(stream)} tokens, fewer than one window of {body}"
                         f"{f' after {len(prefix)} leading special token(s)' if prefix else ''}: "
                         "upload more text or choose a shorter sequence length")
    if windows < n_samples:
        warnings.warn(f"the text has {len(stream)} tokens: {windows} windows of {seq_len} tokens "
                      f"instead of the {n_samples} asked for", ShortTextWarning, stacklevel=2)
    pieces = torch.tensor(stream[: windows * body], dtype=torch.long).view(windows, body)
    if not prefix:
        return pieces
    return torch.cat([torch.tensor(prefix, dtype=torch.long).expand(windows, -1), pieces], dim=1)
