"""The deployment the application layer works on: its settings, and whether its database is ready."""

from __future__ import annotations

from store.db import check_schema_current
from store.settings import Settings, get_settings


def settings() -> Settings:
    """The settings of this deployment (store.settings.get_settings: the environment, read once)."""
    return get_settings()


def schema_problem() -> str | None:
    """None when the database is ready, else the message that says how to fix it."""
    try:
        check_schema_current(settings())
    except Exception as exc:
        return str(exc)
    return None
