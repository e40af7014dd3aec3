"""The application layer's one error for a use case that refuses what was asked.

:class:`Refused` carries a message written for a person: what is wrong and what to do about it. It is a
ValueError, so the pages (which show a ValueError's message) and the CLI (which prints it after ``quantplan:`` and
exits 1) show it as they show any refusal, and callers that catch ValueError keep working.
"""

from __future__ import annotations


class Refused(ValueError):
    """A use case refused its request; ``str(exc)`` is the sentence to show (nothing was saved or queued)."""
