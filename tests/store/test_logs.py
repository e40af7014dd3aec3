"""Logging is configured once per process: first-party INFO lines reach stderr, once, whatever calls it."""

from __future__ import annotations

import logging

import pytest

from store.logs import FIRST_PARTY, configure_logging


@pytest.fixture
def clean_loggers():
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers)) for n in FIRST_PARTY}
    yield
    for name, (level, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers


def test_a_workers_info_line_reaches_stderr_once_even_when_configured_twice(clean_loggers, capsys):
    configure_logging("INFO")
    configure_logging("INFO")
    logging.getLogger("worker.runner").info("job 12 succeeded")
    logging.getLogger("worker.runner").debug("not at INFO")
    err = capsys.readouterr().err
    assert err.count("INFO worker.runner: job 12 succeeded") == 1
    assert "not at INFO" not in err


def test_the_level_comes_from_the_setting(clean_loggers, capsys, monkeypatch):
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_LOG_LEVEL", "WARNING")
    clear_settings_cache()
    configure_logging()
    logging.getLogger("store.cache").info("quiet")
    logging.getLogger("store.cache").warning("loud")
    err = capsys.readouterr().err
    assert "loud" in err and "quiet" not in err


def test_a_misspelt_level_is_refused_with_the_variable_named(clean_loggers):
    with pytest.raises(ValueError, match="QUANTPLAN_LOG_LEVEL='LOUD' is not a logging level"):
        configure_logging("LOUD")
