"""`quantplan plan ...`: automatic plans, export to serving tools, import of plan files."""

from __future__ import annotations


def add_commands(sub) -> None:
    return None
