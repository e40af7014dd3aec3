"""Bounded reading of the text files people hand quantplan: plan files, llm-compressor recipes, imported configs
(YAML), and the JSON of a checkpoint (``config.json``, tokenizer settings, shard indexes, safetensors headers).

One loader for all of them, so every call site gets the same limits and the same kind of message:

- a size cap, checked before anything is parsed;
- YAML anchors and aliases refused (a "billion laughs" document of nested aliases expands exponentially), and a
  nesting-depth cap on YAML and JSON alike (checked before ``json.loads`` for JSON, so no ``RecursionError``);
- a binary file is "<file> is not a text file", never a codec error;
- every failure is a sentence that names the file and quotes at most one line of the input, cut to
  :data:`QUOTE_CHARS` characters.

Failures raise the error class the caller names (``PlanError`` for plans and recipes, ``CheckpointError`` for a
checkpoint's JSON), so each front end keeps handling its own domain error. Torch-free; imports only yaml and json.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from pathlib import Path
from typing import Any

import yaml

MAX_PLAN_BYTES = 4 * 1024 * 1024  # a plan for a 100-layer MoE model is ~1 MB of YAML; 4 MiB is a generous cap
MAX_JSON_BYTES = 16 * 1024 * 1024  # config.json is KBs; a tokenizer_config.json or a shard index a few MBs
MAX_DEPTH = 64  # a plan or a config nests 3-6 levels; deeper is a mistake or an attack
QUOTE_CHARS = 80  # at most this much of one input line is quoted in a message
MAX_NAME_CHARS = 120  # a file or member name longer than this is cut in a message


def short(text: object, limit: int = QUOTE_CHARS) -> str:
    """``text`` as one line of at most ``limit`` characters (``…`` marks a cut): for quoting input in a message."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def short_name(name: object, limit: int = MAX_NAME_CHARS) -> str:
    """A file or archive member name for a message, repr-quoted, its middle cut when longer than ``limit``."""
    text = str(name)
    if len(text) > limit:
        keep = (limit - 1) // 2
        text = f"{text[:keep]}…{text[-keep:]} ({len(text):,} characters)"
    return repr(text)


def display_name(name: object, limit: int = MAX_NAME_CHARS) -> str:
    """A file name for a message: as it is when short, else :func:`short_name` (quoted, its middle cut)."""
    text = str(name)
    return text if len(text) <= limit else short_name(text, limit)


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes:,} bytes"


def _line(text: str, line_no: int) -> str:
    """Line ``line_no`` (from 1) of text, quoted and cut; '' when there is none."""
    lines = text.splitlines()
    if 1 <= line_no <= len(lines) and lines[line_no - 1].strip():
        return f": {short(lines[line_no - 1])!r}"
    return ""


def as_text(data: bytes | str, source: str, error: type[Exception], *, max_bytes: int) -> str:
    """Check size and text-ness of an input: its text, or ``error`` with a sentence naming ``source``.

    ``data`` may already be a str (an upload decoded with errors="replace" still shows U+FFFD where it was not
    text, and a NUL character is never in a text file)."""
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise error(f"{source} is {_size(size)}, above the {_size(max_bytes)} it may be: is it the right file?")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise error(f"{source} is not a text file (it holds bytes that are not UTF-8 text): "
                        "give the YAML or JSON file itself") from None
    else:
        text = data
    if "\0" in text or "\ufffd" in text:
        raise error(f"{source} is not a text file (it holds binary bytes): give the YAML or JSON file itself")
    return text.removeprefix("\ufeff")


def read_input(path: str | Path, error: type[Exception], *, max_bytes: int = MAX_PLAN_BYTES,
               what: str = "file") -> tuple[str, str]:
    """Read a file for parsing, refusing it past ``max_bytes`` before reading: (its text, its name for messages:
    ``what`` and the quoted name, e.g. "plan file 'a.yaml'", or the bare name when ``what`` is empty)."""
    p = Path(path)
    source = f"{what} {short_name(str(p))}" if what else display_name(p.name)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise error(f"{source} is not a regular file")
        if size > max_bytes:
            raise error(f"{source} is {_size(size)}, above the {_size(max_bytes)} it may be: is it the right file?")
        with p.open("rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot read {source}: {exc.strerror or type(exc).__name__}") from None
    return as_text(data, source, error, max_bytes=max_bytes), source


# --- YAML -----------------------------------------------------------------------------------------------------


class _BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain data only) that refuses anchors / aliases and nesting past ``MAX_DEPTH``."""

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _Refusal("uses YAML anchors or aliases (& / *), which quantplan does not expand: write the "
                           "values out", event.start_mark)
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Refusal(f"nests deeper than {MAX_DEPTH} levels", event.start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _Refusal(Exception):
    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(problem)
        self.problem, self.mark = problem, mark


def yaml_problem(exc: Exception, text: str = "") -> str:
    """A YAML error in one line: the problem, where (line and column, counted from 1) with that line quoted when
    ``text`` is given, and for the usual mistake in a plan, a backslash of a regular expression in a double-quoted
    string, what to write instead."""
    problem = getattr(exc, "problem", None)
    if not problem:
        return short(exc, 200)
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}{_line(text, mark.line + 1)}" if mark else ""
    hint = ("; in double quotes a backslash starts an escape: write a regular expression in single quotes "
            "('layers\\.0\\.')" if "escape character" in problem else "")
    return f"{short(problem, 200)}{where}{hint}"


def load_yaml(data: bytes | str, source: str, error: type[Exception], *,
              max_bytes: int = MAX_PLAN_BYTES) -> Any:
    """Parse YAML (or JSON, a subset) into plain data within the limits: the document, None when it is empty.

    ``source`` names the input in every message (e.g. "plan file 'a.yaml'"); ``error`` is raised for an input too
    large, not text, not YAML, with anchors / aliases, or nested deeper than :data:`MAX_DEPTH`."""
    text = as_text(data, source, error, max_bytes=max_bytes)
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass: plain data only
    except _Refusal as exc:
        line = exc.mark.line + 1 if exc.mark is not None else 0
        raise error(f"{source} {exc.problem} (line {line}{_line(text, line)})") from None
    except yaml.YAMLError as exc:
        raise error(f"{source} is not valid YAML: {yaml_problem(exc, text)}") from None
    except RecursionError:  # pragma: no cover - the depth cap comes first
        raise error(f"{source} nests too deeply to read") from None


# --- JSON -----------------------------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets: deleted before counting
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (0 for a scalar), strings ignored; no parsing."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _BRACKETS)
    return max(accumulate(_STEP[b] for b in brackets), default=0)


def load_json(data: bytes | str, source: str, error: type[Exception], *, max_bytes: int = MAX_JSON_BYTES,
              max_depth: int = MAX_DEPTH) -> Any:
    """Parse JSON within the limits: a size cap and a nesting cap checked before ``json.loads``; ``error`` with a
    sentence naming ``source`` (and the line at fault, cut) otherwise."""
    text = as_text(data, source, error, max_bytes=max_bytes)
    raw = text.encode("utf-8") if isinstance(data, str) else data
    depth = json_depth(raw)
    if depth > max_depth:
        raise error(f"{source} nests {depth:,} levels deep, more than the {max_depth} a configuration could need")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{source} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}"
                    f"{_line(text, exc.lineno)})") from None
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise error(f"{source} nests too deeply to read") from None


def read_json(path: str | Path, error: type[Exception], *, max_bytes: int = MAX_JSON_BYTES,
              what: str = "") -> Any:
    """:func:`load_json` of a file, refused past ``max_bytes`` before it is read."""
    text, source = read_input(path, error, max_bytes=max_bytes, what=what)
    return load_json(text, source, error, max_bytes=max_bytes)
