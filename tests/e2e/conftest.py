"""Real processes: a Celery worker (and the Streamlit app) started as a user would start them (tests.factories)."""

from __future__ import annotations

import pytest

from tests.factories import start_worker


@pytest.fixture
def worker(qp_settings, tmp_path):
    proc = start_worker(tmp_path)
    yield proc
    proc.stop()


@pytest.fixture
def team_settings(qp_env, pg_database, redis_url, monkeypatch):
    """The team setup's settings: PostgreSQL (migrated) and Redis as broker and result backend, on the test's own
    database and Redis database number (emptied first)."""
    import redis

    from store.db import upgrade
    from store.settings import get_settings
    from tests.conftest import clear_settings_cache

    redis.Redis.from_url(redis_url).flushdb()  # our own test database number only
    monkeypatch.setenv("QUANTPLAN_DATABASE_URL", pg_database)
    monkeypatch.setenv("QUANTPLAN_BROKER_URL", redis_url)
    monkeypatch.setenv("QUANTPLAN_RESULT_BACKEND", redis_url)
    clear_settings_cache()
    s = get_settings()
    upgrade(s)
    return s
