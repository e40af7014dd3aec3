"""Real processes: a Celery worker (and the Streamlit app) started as a user would start them (tests.factories)."""

from __future__ import annotations

import json
import os
import secrets
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.browser import CHROMIUM, CHROMIUM_ARGS, PAGE_TIMEOUT_MS
from tests.factories import Proc, free_port, start_worker

PEOPLE = (("ann@example.com", "Ann"), ("bob@example.com", "Bob"))  # who the OIDC provider knows


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


@pytest.fixture
def app_url(qp_settings, tmp_path):
    """The app (`quantplan app`) on a free port, on the test's settings; its output in app.log."""
    port = free_port()
    proc = Proc([sys.executable, "-m", "quantplan", "app"], dict(os.environ, QUANTPLAN_UI_PORT=str(port)),
                tmp_path / "app.log")
    try:
        proc.wait_for("URL: http", timeout=300)  # a busy machine starts Streamlit slowly
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture
def page():
    """A headless Chromium page at 1400 x 1000 with the generous timeout."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (./dev.sh test installs it)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 1000})
        pg.set_default_timeout(PAGE_TIMEOUT_MS)
        yield pg
        browser.close()


@pytest.fixture
def provider():
    """A real OpenID Connect provider on a local port (oidc-provider-mock); ann's and bob's claims set as a real
    provider would hold them."""
    oidc_provider_mock = pytest.importorskip("oidc_provider_mock")
    with oidc_provider_mock.run_server_in_thread() as server:
        url = f"http://localhost:{server.server_port}"
        for email, name in PEOPLE:
            req = urllib.request.Request(f"{url}/users/{email}", method="PUT",
                                         data=json.dumps({"email": email, "name": name}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 204
        yield url


@pytest.fixture
def oidc_app(qp_settings, provider, tmp_path):
    """The app with QUANTPLAN_AUTH=oidc, its provider in a secrets.toml [auth] as Streamlit documents it."""
    port = free_port()
    app_url = f"http://127.0.0.1:{port}"
    secrets_file = tmp_path / "secrets.toml"
    secrets_file.write_text(
        "[auth]\n"
        f'redirect_uri = "{app_url}/oauth2callback"\n'
        f'cookie_secret = "{secrets.token_hex(32)}"\n'
        'client_id = "quantplan"\n'
        f'client_secret = "{secrets.token_hex(16)}"\n'
        f'server_metadata_url = "{provider}/.well-known/openid-configuration"\n')
    env = dict(os.environ, QUANTPLAN_UI_PORT=str(port), QUANTPLAN_AUTH="oidc",
               STREAMLIT_SECRETS_FILES=str(secrets_file))
    proc = Proc([sys.executable, "-m", "quantplan", "app"], env, tmp_path / "app.log")
    try:
        proc.wait_for("URL: http", timeout=300)
        yield app_url
    finally:
        proc.stop()
