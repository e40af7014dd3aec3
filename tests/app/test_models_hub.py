"""The Models page's "Register from the Hub" input (AppTest) against a local Hub (tests/hub_server.py): it queues a
register job with the hub id and revision (never the token), says only whether QUANTPLAN_HF_TOKEN is set, and,
with the Hub unreachable or HF_HUB_OFFLINE set, says so instead of queueing a job that would fail."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from tests.factories import free_port
from tests.hub_server import PUBLIC, TOKEN, set_token

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")


def _models_page() -> AppTest:
    at = AppTest.from_file(MAIN, default_timeout=120)
    at.run()
    at.switch_page("views/models.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _shown(at: AppTest) -> str:
    """Every text the page shows, and the page's whole element tree as Streamlit holds it."""
    texts = [e.value for kind in ("markdown", "caption", "success", "error", "info", "warning", "text_input")
             for e in getattr(at, kind)]
    return "\n".join(map(str, texts)) + repr(at._tree)


def _register_jobs():
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        return repo.list_jobs(s, kind="register")


def test_the_page_queues_a_hub_registration_and_shows_the_token_nowhere(hub, monkeypatch):
    set_token(monkeypatch, TOKEN)
    at = _models_page()
    assert any("QUANTPLAN_HF_TOKEN is **set**" in c.value for c in at.caption)
    at.button(key="register_hub").click().run()  # nothing typed: it says what to type
    assert any(e.value.startswith("Type a Hugging Face model id first") for e in at.error)
    assert _register_jobs() == []
    at.text_input(key="hub_id").input(f"hf://{PUBLIC}@main").run()
    at.button(key="register_hub").click().run()
    assert not at.exception
    [job] = _register_jobs()
    assert any(s.value == f"Queued registration job #{job.id} for hf://{PUBLIC}@main." for s in at.success)
    assert job.params["hub"] == PUBLIC and job.params["revision"] == "main"
    assert TOKEN not in repr(job.params)
    shown = _shown(at)
    assert "QUANTPLAN_HF_TOKEN is **set**" in shown and f"hf://{PUBLIC}@main" in shown  # it holds the page
    assert TOKEN not in shown
    assert all(TOKEN not in repr(at.session_state[k]) for k in at.session_state)


def test_the_page_says_the_token_is_not_set(hub):
    at = _models_page()
    assert any("QUANTPLAN_HF_TOKEN is **not set**" in c.value for c in at.caption)


def test_offline_or_an_unreachable_hub_is_said_on_the_page_and_nothing_is_queued(hub, monkeypatch):
    from tests.conftest import clear_settings_cache

    at = _models_page()
    at.text_input(key="hub_id").input(f"hf://{PUBLIC}").run()
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    at.button(key="register_hub").click().run()
    assert any(e.value.startswith("the hub is unreachable (HF_HUB_OFFLINE is set)") for e in at.error)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    clear_settings_cache()
    at.button(key="register_hub").click().run()
    assert any(e.value.startswith(f"the hub is unreachable (no answer from {closed}") for e in at.error)
    assert _register_jobs() == []
