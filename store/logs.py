"""Logging, configured once per process (app, worker, CLI) the same way.

Every module logs under its own dotted name (``logging.getLogger(__name__)``: ``worker.runner``,
``store.cache``, ``quantcore.models.intake``...). :func:`configure_logging` gives those first-party
loggers one stderr handler at ``QUANTPLAN_LOG_LEVEL`` (INFO by default), so a worker's lines such as
"job 12 succeeded" reach its terminal or container log, and leaves the root logger and third-party
loggers (Celery, Streamlit, transformers) as their own owners set them. Records still propagate to the
root logger (pytest's caplog listens there) except in a worker, whose root logger Celery gives a handler of its
own: a line prints once.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

FIRST_PARTY = ("app", "quantplan", "jobs", "store", "worker", "quantcore")  # the top-level packages
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MARK = "_quantplan_handler"  # set on the handler this module adds, so a second call adds none


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (a test's capture, a redirected stream), not
    to the stream that was there when logging was configured."""

    @property
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def configure_logging(level: str | int | None = None, stream: TextIO | None = None, *,
                      propagate: bool = True) -> None:
    """Send first-party log lines at ``level`` (default: the ``log_level`` setting) to ``stream`` (default: the
    process's ``sys.stderr`` at the time of each line); idempotent.

    A Celery worker passes ``sys.__stderr__`` (it replaces ``sys.stderr`` with a proxy into its own logging once it
    starts, and lines written there would be lost) and ``propagate=False`` (its root logger prints every record
    again, in Celery's format)."""
    if level is None:
        from store.settings import get_settings

        level = get_settings().log_level
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"QUANTPLAN_LOG_LEVEL={level!r} is not a logging level: use DEBUG, INFO, WARNING or ERROR")
    for name in FIRST_PARTY:
        logger = logging.getLogger(name)
        logger.setLevel(numeric)
        logger.propagate = propagate
        if not any(getattr(h, _MARK, False) for h in logger.handlers):
            handler = _StderrHandler() if stream is None else logging.StreamHandler(stream)
            handler.setFormatter(logging.Formatter(FORMAT))
            setattr(handler, _MARK, True)
            logger.addHandler(handler)


__all__ = ["FIRST_PARTY", "configure_logging"]
