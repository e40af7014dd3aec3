"""Keep docs/reference/cli.md's usage blocks equal to argparse's own, and list the options it does not describe.

    python scripts/cli_doc.py          # rewrite every ``usage:`` block of docs/reference/cli.md from the parser
    python scripts/cli_doc.py --check  # exit 1 naming each block that differs and each undocumented option

A command's section is its ``### `quantplan NAME``` (or ``#### `quantplan NAME SUB```) heading; the usage block
is the first fenced block in it that starts with ``usage: quantplan``. The argument tables and the prose are
written by hand (they link to the concept pages), so the check asks only that every option string of the
command appears somewhere in its section.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reference" / "cli.md"
WIDTH = 100  # the usage lines' width in the doc
HEADING = re.compile(r"^#{3,4} `quantplan ([a-z][a-z -]*)`$", re.M)
USAGE = re.compile(r"```\n(usage: quantplan .*?)\n```", re.S)


Parser = argparse.ArgumentParser


def commands(parser: Parser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, Parser]]:
    """Every (sub)command's name ("plan auto") and parser, depth first."""
    if path:
        yield " ".join(path), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def usage(parser: argparse.ArgumentParser) -> str:
    os.environ["COLUMNS"] = str(WIDTH)
    return parser.format_usage().strip()


def sections(text: str) -> dict[str, tuple[int, int]]:
    """Command name -> (start, end) of its section in the doc."""
    heads = list(HEADING.finditer(text))
    ends = [m.start() for m in heads[1:]] + [len(text)]
    return {m.group(1): (m.end(), end) for m, end in zip(heads, ends, strict=True)}


def render(text: str, parsers: dict[str, argparse.ArgumentParser]) -> str:
    """The doc with every command's usage block replaced by argparse's."""
    spans = sections(text)
    for name in sorted(spans, key=lambda n: spans[n][0], reverse=True):
        if name not in parsers:
            continue
        start, end = spans[name]
        body = text[start:end]
        block = USAGE.search(body)
        if block is None:
            continue
        body = body[: block.start(1)] + usage(parsers[name]) + body[block.end(1) :]
        text = text[:start] + body + text[end:]
    return text


def problems(text: str, parsers: dict[str, argparse.ArgumentParser]) -> list[str]:
    found = []
    spans = sections(text)
    for name, parser in parsers.items():
        if name not in spans:
            found.append(f"{DOC.name}: no section for `quantplan {name}`")
            continue
        start, end = spans[name]
        body = text[start:end]
        block = USAGE.search(body)
        if block is not None and block.group(1) != usage(parser):
            found.append(f"{DOC.name}: the usage block of `quantplan {name}` is not argparse's "
                         "(run scripts/cli_doc.py)")
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help") and f"`{option}" not in body and f" {option}" not in body:
                    found.append(f"{DOC.name}: `quantplan {name}` does not describe {option}")
    return found


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    from quantplan.cli.main import build_parser

    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="change nothing; exit 1 if the doc lags the parser")
    check = args.parse_args(argv).check
    parsers = dict(commands(build_parser()))
    text = DOC.read_text()
    if not check:
        DOC.write_text(render(text, parsers))
        text = DOC.read_text()
    found = problems(text, parsers)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
