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


def xdist_index() -> int:
    """This process's pytest-xdist worker number (gw0 -> 0, gw1 -> 1, ...); 0 in a plain run (no xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0


# Under pytest-xdist each worker gets its share of the cores for torch's (OpenMP's) threads, set before torch's import
# and inherited by the processes a test starts: two workers of two threads each on CI's 2 cores spin against each other
# (tests/worker took 448 s so on a loaded machine, 262 s serially; docs/contributing/testing.md)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, _threads)


# Redis: two database numbers for each xdist worker, counted down from the URL's (15 by default): the e2e tests'
# (REDIS_URL, the redis_url fixture) and, one below it, the hardening tests' (tests/hardening/test_workers.py). Each
# test flushes its own number, so two workers must never share one: gw0 gets 15 and 14, gw1 13 and 12, ...
REDIS_DBS_PER_WORKER = 2
_REDIS_BASE = os.environ.get("QUANTPLAN_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
REDIS_DB = int(_REDIS_BASE.rsplit("/", 1)[1]) - REDIS_DBS_PER_WORKER * xdist_index()
REDIS_URL = _REDIS_BASE.rsplit("/", 1)[0] + f"/{REDIS_DB}"

# The machine's cache (QUANTPLAN_CACHE_DIR, else ~/.cache/quantplan) as this run started: its GGUF conversions and
# the assembled demo GGUF are slow to make (40-90 s each) and safe to share (each is written to a temporary sibling
# and renamed into place), so every test's own cache folder (qp_env) links to them; its job scratch folders are not
# (job ids start at 1 in every test's database, and a worker's sweep removes the folders of jobs its database does
# not call running), so they stay in the test's folder.
MACHINE_CACHE = Path(os.environ.get("QUANTPLAN_CACHE_DIR") or "~/.cache/quantplan").expanduser()
SHARED_CACHE_SUBDIRS = ("gguf", "demo")  # quantcore.models.intake's GGUF_CACHE_SUBDIR and the demo folder


# A CPU kernel benchmark writes twice the last-level cache before each timed call; this VM reports a 480 MiB L3, and
# those 960 MiB flushes were most of every benchmark test's time (a tiny model's GEMMs take microseconds). What the
# tests check (reuse, budgets, records) does not depend on the flush's size: 16 MiB here, for every test and every
# process a test starts; tests/quantcore/kernels/test_timing.py checks the rule itself.
os.environ.setdefault("QUANTPLAN_CPU_FLUSH_MIB", "16")
KEPT_ENV = {"QUANTPLAN_CPU_FLUSH_MIB"}  # kept by qp_env, which clears every other QUANTPLAN_* (and sets the cache)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` (./dev.sh test) on pytest 9.2: give each test of an ``xdist_group`` its group suffix.

    pytest-xdist 3.8 tells its scheduler a test's group by appending ``@group`` to the test's node id in the worker,
    through ``item._nodeid``, which pytest 9.2 no longer reads (its node ids are structured, ``item._id``): the
    groups silently stop grouping and a module fixture is set up again on every worker that gets one of its tests
    (pytest-dev/pytest-xdist#1386). Same suffix, set where pytest 9.2 reads it; nothing to do where xdist did it."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers for --dist loadgroup only
        return
    from _pytest.nodeid import NodeId

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid.rpartition("]")[2]:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def clear_settings_cache() -> None:
    from store.settings import get_settings

    get_settings.cache_clear()


def own_cache_dir(tmp_path: Path) -> Path:
    """``tmp_path/cache``: a test's own QUANTPLAN_CACHE_DIR (its job scratch folders), whose shared subfolders
    (SHARED_CACHE_SUBDIRS) link to the machine's cache."""
    cache = tmp_path / "cache"
    for name in SHARED_CACHE_SUBDIRS:
        if not (cache / name).exists():
            (MACHINE_CACHE / name).mkdir(parents=True, exist_ok=True)
            cache.mkdir(exist_ok=True)
            (cache / name).symlink_to(MACHINE_CACHE / name, target_is_directory=True)
    return cache


@pytest.fixture
def qp_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Environment of an embedded deployment in tmp_path (not migrated)."""
    home = tmp_path / "home"
    env = {
        "QUANTPLAN_HOME": str(home),
        "QUANTPLAN_USER": "tester",
        "QUANTPLAN_UPLOAD_LIMIT_MB": "2048",
        "QUANTPLAN_CACHE_DIR": str(own_cache_dir(tmp_path)),
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
    if REDIS_DB - (REDIS_DBS_PER_WORKER - 1) < 0:
        pytest.skip(f"xdist worker {xdist_index()} has no Redis database numbers left (two a worker, from "
                    f"{_REDIS_BASE}): run fewer workers")
    return REDIS_URL
