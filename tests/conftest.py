"""Shared fixtures: a fresh quantplan home (SQLite + SQLAlchemy broker) per test, and PostgreSQL /
Redis when this machine has them (skipped with the reason otherwise)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PG_ADMIN_URL = os.environ.get("QUANTPLAN_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("QUANTPLAN_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


# A CPU kernel benchmark writes twice the last-level cache before each timed call; this VM reports a 480 MiB L3, and
# those 960 MiB flushes were most of every benchmark test's time (a tiny model's GEMMs take microseconds). What the
# tests check (reuse, budgets, records) does not depend on the flush's size: 16 MiB here, for every test and every
# process a test starts; tests/quantcore/kernels/test_timing.py checks the rule itself.
os.environ.setdefault("QUANTPLAN_CPU_FLUSH_MIB", "16")
KEPT_ENV = {"QUANTPLAN_CACHE_DIR", "QUANTPLAN_CPU_FLUSH_MIB"}  # kept by qp_env, which clears every other QUANTPLAN_*


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def clear_settings_cache() -> None:
    from store.settings import get_settings

    get_settings.cache_clear()


@pytest.fixture
def qp_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment of an embedded deployment in tmp_path (not migrated)."""
    home = tmp_path / "home"
    env = {
        "QUANTPLAN_HOME": str(home),
        "QUANTPLAN_USER": "tester",
        "QUANTPLAN_UPLOAD_LIMIT_MB": "2048",
    }
    for k in list(os.environ):
        if k.startswith("QUANTPLAN_") and k not in env and k not in KEPT_ENV:
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    clear_settings_cache()
    yield env
    clear_settings_cache()


@pytest.fixture
def qp_settings(qp_env):
    """Settings of a migrated embedded deployment."""
    from store.db import upgrade
    from store.settings import get_settings

    s = get_settings()
    upgrade(s)
    return s


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session; skipped when PostgreSQL does not answer."""
    if not _port_open("127.0.0.1", 5432):
        pytest.skip("PostgreSQL does not answer on 127.0.0.1:5432")
    from sqlalchemy import create_engine, text

    name = f"quantplan_test_{uuid.uuid4().hex[:8]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"cannot create a PostgreSQL database via {PG_ADMIN_URL}: {exc}")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    yield url
    with admin.connect() as c:
        c.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"))
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


@pytest.fixture(scope="session")
def redis_url() -> str:
    if not _port_open("127.0.0.1", 6379):
        pytest.skip("Redis does not answer on 127.0.0.1:6379")
    return REDIS_URL
