"""The one error a job contract raises: a job that cannot be queued (or run) as asked."""

from __future__ import annotations


class InvalidJob(ValueError):
    """A job's parameters break its contract (jobs.specs): the message is a sentence for a person naming the
    parameter, the value given and what is allowed. A ValueError, so callers that show a ValueError's message
    (the pages, the CLI, the worker's failed-job row) show it unchanged."""
