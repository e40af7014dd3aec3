"""docs/reference/cli.md keeps up with the parser: every usage block is argparse's own, every option is described."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from quantplan.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("cli_doc", ROOT / "scripts" / "cli_doc.py")
assert _spec is not None and _spec.loader is not None
cli_doc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli_doc)


def test_the_cli_reference_matches_the_parser():
    parsers = dict(cli_doc.commands(build_parser()))
    assert {"calibrate", "score", "sensitivity", "plan auto", "models add"} <= set(parsers)
    assert cli_doc.problems(cli_doc.DOC.read_text(), parsers) == []


def test_a_lagging_reference_is_named():
    parsers = dict(cli_doc.commands(build_parser()))
    text = cli_doc.DOC.read_text()
    # an option's row gone and a usage block from an older parser: both named, the block fixed by render()
    lagging = text.replace("| `--rotation-seed` `S` |", "| (removed) |").replace(
        "[--timeout SECONDS] [--json]\n                           [--stream | --no-stream]",
        "[--json] [--stream | --no-stream]", 1)
    found = cli_doc.problems(lagging, parsers)
    assert "cli.md: `quantplan calibrate` does not describe --rotation-seed" in found
    assert any("usage block of `quantplan calibrate`" in line for line in found)
    assert not any("usage block" in line for line in cli_doc.problems(cli_doc.render(lagging, parsers), parsers))
