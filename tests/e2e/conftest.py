"""Real processes: a Celery worker (and the Streamlit app) started as a user would start them (tests.factories)."""

from __future__ import annotations

import pytest

from tests.factories import start_worker


@pytest.fixture
def worker(qp_settings, tmp_path):
    proc = start_worker(tmp_path)
    yield proc
    proc.stop()
