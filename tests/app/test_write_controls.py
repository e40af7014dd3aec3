"""Pages offer a person only the write controls their role allows (app.auth.may; issue 44): a viewer sees no queue,
save, note, choose, remove or clear button, a member sees queue / save / note / choose but no remove or clear, an
admin sees them all; the services refuse regardless (tests/quantplan/services/test_access.py). A removed model is
listed with its marker and purged by an admin from the Models page; the Plans page shows the chosen version."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from quantplan.services import access

MAIN = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
PAGES = ("models", "results", "kernels", "plans", "jobs")
MEMBER_WRITES = {"Register the demo model", "Queue calibration", "Queue", "Queue benchmark", "Save as a new version",
                 "Add note", "Mark as chosen", "Choose and verify"}
ADMIN_WRITES = {"Remove model", "Clear cached files"}


@pytest.fixture
def people(seeded, monkeypatch):
    """ann (admin: the first to sign in), bob (member), cyd (viewer); the page's person is set per test."""
    from quantplan.services import plans as plans_svc

    ann = access.sign_in("ann@example.com")
    access.sign_in("bob@example.com")
    cyd = access.sign_in("cyd@example.com")
    with access.acting(ann):
        access.set_role("bob@example.com", "member")
        plans_svc.save_plan(seeded.id, "p", {"default": "FP8_DYNAMIC"})  # the Plans page then has a version
    monkeypatch.setattr(access, "_SIGNIN_REQUIRED", True)  # as the app with a sign-in: the session's person acts
    who: dict[str, access.Actor] = {"admin": ann, "member": access.Actor("bob@example.com", "member"), "viewer": cyd}
    state = {"now": ann}
    monkeypatch.setattr(access, "_SIGNED_IN", lambda: state["now"])

    def be(role: str) -> access.Actor:
        state["now"] = who[role]
        return who[role]

    return be


def _labels(role_page_runs) -> set[str]:
    return {b.label for at in role_page_runs for b in at.button}


def _pages(model_id: int) -> list[AppTest]:
    runs = []
    for page in PAGES:
        at = AppTest.from_file(MAIN, default_timeout=120)
        at.session_state["model_id"] = model_id
        at.session_state["results_score_open"] = True  # the Results page's score form, built once opened
        at.run()
        if page != "models":
            at.switch_page(f"views/{page}.py").run()
        assert not at.exception, (page, [e.value for e in at.exception])
        runs.append(at)
    return runs


def test_a_viewer_is_offered_no_write_control_a_member_some_an_admin_all(seeded, people):
    people("viewer")
    runs = _pages(seeded.id)
    offered = _labels(runs)
    assert not offered & (MEMBER_WRITES | ADMIN_WRITES), offered & (MEMBER_WRITES | ADMIN_WRITES)
    captions = " ".join(c.value for at in runs for c in at.caption)
    assert "cyd@example.com is a viewer: queueing a job needs the member role" in captions
    assert "cyd@example.com is a viewer: writing a note needs the member role" in captions
    said = " ".join(m.value for m in runs[0].markdown)  # the Remove box says why, as the service would refuse
    assert "cyd@example.com is a viewer: removing a model needs the admin role" in said

    people("member")
    offered = _labels(_pages(seeded.id))
    assert {"Queue calibration", "Queue", "Queue benchmark", "Save as a new version", "Add note",
            "Mark as chosen"} <= offered, offered
    assert not offered & ADMIN_WRITES

    people("admin")
    offered = _labels(_pages(seeded.id))
    assert ADMIN_WRITES <= offered and "Queue calibration" in offered


def test_a_member_chooses_a_version_on_the_plans_page_and_it_is_shown(seeded, people):
    from quantplan.services import choices as choices_svc

    people("member")
    at = _pages(seeded.id)[PAGES.index("plans")]
    at.text_input(key=f"choose_why_{seeded.id}").set_value("fits one H100")
    next(b for b in at.button if b.label == "Mark as chosen").click().run()
    assert not at.exception, [e.value for e in at.exception]
    chosen = choices_svc.chosen_for(seeded.id)
    assert chosen is not None and (chosen.label, chosen.chosen_by, chosen.why) == ("p v1", "bob@example.com",
                                                                                  "fits one H100")
    shown = " ".join(m.value for m in at.markdown)
    assert f"**p v1** is the version chosen for {seeded.name}, by bob@example.com on " in shown
    assert "Why: fits one H100" in shown


def test_an_admin_purges_a_removed_model_from_the_models_page(seeded, people):
    from quantplan.services import models as models_svc

    admin = people("admin")
    with access.acting(admin):
        models_svc.remove_model(seeded.id)
    people("viewer")
    at = _pages(seeded.id)[0]
    assert any(e.label == "Removed models (1)" for e in at.expander)
    assert "Purge model" not in {b.label for b in at.button}  # a viewer reads the list, purges nothing
    people("admin")
    at = _pages(seeded.id)[0]
    at.checkbox(key=f"purge_sure_{seeded.id}").check().run()
    at.button(key=f"purge_{seeded.id}").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(f"Purged {seeded.name}" in s.value for s in at.success)
    assert models_svc.removed_models() == [] and models_svc.list_models(include_removed=True) == []
