"""Issue 44's "Done when", in headless Chromium against the app with QUANTPLAN_AUTH=oidc and a real OpenID Connect
provider (oidc-provider-mock, in this process), and a real worker: ann, a member, scores a plan version of a tiny
model and tags the run; bob, a viewer, finds that run on the History page by ann's name, opens its page (the software
the worker recorded, the plan's change from its parent), follows its "compare with" link, and is refused when he
tries to remove the model, with the reason shown. Every wait polls a state (a row, a page's words), none sleeps."""

from __future__ import annotations

import re
import time

import pytest

from jobs.client import submit_job, wait_for
from store import repo
from store.db import session_scope
from tests.e2e.browser import PAGE_TIMEOUT_MS, no_exception
from tests.e2e.test_browser import JOB_DEADLINE_S
from tests.factories import save_tiny_llama

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]

ANN, BOB = "ann@example.com", "bob@example.com"


@pytest.fixture
def team(qp_settings, worker, tmp_path):
    """What the team's admin set up before: ann a member and bob a viewer (the lead signed in first, so is admin),
    a tiny model registered by a real job on the worker, plan "fast" in two versions (v2 keeps down_proj in BF16),
    and another score run of the model to compare with."""
    from quantplan.services import access
    from quantplan.services import plans as plans_svc

    access.sign_in("lead@example.com")  # the first person: admin
    for person, role in ((ANN, "member"), (BOB, "viewer")):
        access.sign_in(person)
        access.set_role(person, role)  # as the operator (`quantplan users set-role`)
    folder = save_tiny_llama(tmp_path / "tiny-llama")
    reg = wait_for(submit_job("register", {"source": str(folder), "name": "tiny"}, settings=qp_settings).id,
                   timeout_s=JOB_DEADLINE_S, settings=qp_settings)
    assert reg.status == "succeeded", reg.error
    model_id = reg.result["model_id"]
    with access.acting(access.Actor(ANN, "member")):
        plans_svc.save_plan(model_id, "fast", {"default": "FP8_DYNAMIC"}, note="everything FP8")
        v2 = plans_svc.save_plan(model_id, "fast", {"default": "FP8_DYNAMIC",
                                                   "layers": {"model.layers.1.mlp.down_proj": "BF16"}},
                                 note="last down_proj back to BF16")
    other = wait_for(submit_job("score", {"scheme": "FP8_DYNAMIC", "samples": 2, "seq_len": 32, "device": "cpu"},
                                model_id=model_id, user="lead@example.com", settings=qp_settings).id,
                     timeout_s=JOB_DEADLINE_S, settings=qp_settings)
    assert other.status == "succeeded", other.error
    return {"model_id": model_id, "plan": v2, "other": other.id}


@pytest.fixture
def oidc_app(team, oidc_app):
    """The app with QUANTPLAN_AUTH=oidc (tests/e2e/conftest.py), started once the team's setup is stored."""
    return oidc_app


@pytest.fixture
def patient():
    """Every expect() of this test polls for as long as a page may take to draw what the database already says on a
    machine whose cores are busy elsewhere (tests.e2e.browser.PAGE_TIMEOUT_MS), not Playwright's 5 s; reset after."""
    from playwright.sync_api import expect

    expect.set_options(timeout=PAGE_TIMEOUT_MS)
    yield
    expect.set_options(timeout=5_000)


def _drawn(tab) -> None:
    """Until the page's script run has ended (Streamlit's running indicator gone): polled, no fixed wait."""
    from playwright.sync_api import expect

    tab.wait_for_load_state("networkidle")
    expect(tab.locator("[data-testid='stStatusWidget']")).to_have_count(0)


def _sign_in(tab, app_url: str, email: str, role: str) -> None:
    from playwright.sync_api import expect

    tab.goto(app_url + "/")
    tab.get_by_role("button", name="Sign in").click()
    tab.get_by_placeholder("sub").fill(email)  # the provider's own form
    tab.get_by_role("button", name="Authorize").click()
    tab.wait_for_url(app_url + "/**")
    expect(tab.get_by_text(f"Signed in as {email} ({role})")).to_be_visible()
    _drawn(tab)


def _sign_out(tab) -> None:
    from playwright.sync_api import expect

    app_url = "/".join(tab.url.split("/", 3)[:3])
    tab.get_by_role("button", name="Sign out").click()
    tab.get_by_role("button", name="End session").click()  # the provider's RP-initiated logout
    tab.wait_for_url(app_url + "/**")
    expect(tab.get_by_role("button", name="Sign in")).to_be_visible()


def _score_job(settings, plan_id: int, timeout: float = JOB_DEADLINE_S):
    """The score job of plan ``plan_id``, once its row says it finished (it must have succeeded)."""
    deadline = time.monotonic() + timeout
    job = None
    while time.monotonic() < deadline:
        with session_scope(settings) as s:
            jobs = [j for j in repo.list_jobs(s, kind="score", limit=20) if j.plan_id == plan_id]
        job = jobs[0] if jobs else None
        if job is not None and job.finished:
            assert job.status == "succeeded", job.error
            return job
        time.sleep(0.5)  # the next poll of the row
    raise TimeoutError(f"no score of plan #{plan_id} finished within {timeout:.0f} s; last seen: {job}")


def test_a_member_scores_and_tags_a_run_a_viewer_finds_opens_compares_it_and_may_not_remove_the_model(
        oidc_app, team, page, qp_settings, patient):  # noqa: F811
    import torch
    from playwright.sync_api import expect

    model_id, plan = team["model_id"], team["plan"]

    # ann, a member: scores plan fast v2 on the Results page (the newest plan not scored yet is chosen already)
    _sign_in(page, oidc_app, ANN, "member")
    page.goto(oidc_app + f"/results?model={model_id}")
    _drawn(page)
    # the score form opens on a click once the model has a score
    page.locator("[data-testid='stExpander'] summary", has_text="Score a plan or preset").click()
    expect(page.get_by_label("Sequences", exact=True)).to_be_visible()
    page.get_by_label("Sequences", exact=True).fill("2")
    page.get_by_label("Tokens each").first.fill("32")
    page.get_by_role("button", name="Queue").click()
    expect(page.get_by_text("Queued score job")).to_be_visible()
    no_exception(page)
    scored = _score_job(qp_settings, plan.id)
    assert scored.requested_by == ANN and scored.model_id == model_id

    # ... and tags it on the run's own page
    page.goto(oidc_app + f"/run?job={scored.id}")
    expect(page.get_by_role("heading", name=f"Run #{scored.id} · score · succeeded")).to_be_visible()
    page.get_by_label("Note", exact=True).fill("good enough to ship")
    page.get_by_label("Tags", exact=True).fill("shipped")
    page.get_by_label("Tags", exact=True).press("Enter")
    _drawn(page)
    page.get_by_role("button", name="Add note").click()
    expect(page.get_by_text(f"Noted on job #{scored.id} by {ANN}.")).to_be_visible()
    no_exception(page)
    _sign_out(page)

    # bob, a viewer: finds the run on the History page by ann's name
    _sign_in(page, oidc_app, BOB, "viewer")
    page.goto(oidc_app + "/history")
    expect(page.get_by_role("heading", name="History")).to_be_visible()
    _drawn(page)
    page.get_by_label("Person").click()
    page.get_by_role("option", name=ANN).click()
    expect(page.get_by_text("1 run(s) match.")).to_be_visible()
    found = re.compile(re.escape(f"#{scored.id} score · tiny · {ANN} · KL ") + r"[0-9.e-]+ ± ")
    expect(page.get_by_role("combobox", name="Run")).to_have_value(found)  # the run, with its KL ± its error
    no_exception(page)

    # ... opens its page: the software its worker recorded, the plan's change from v1, ann's tag
    page.get_by_role("link", name=f"Open run #{scored.id}").click()
    page.wait_for_url(f"{oidc_app}/run?job={scored.id}*")  # the sidebar may add its ?model=
    expect(page.get_by_role("heading", name=f"Run #{scored.id} · score · succeeded")).to_be_visible()
    expect(page.get_by_role("cell", name=str(torch.__version__), exact=True)).to_be_visible()
    expect(page.get_by_text("1 layer(s) changed from fast v1: last down_proj back to BF16.")).to_be_visible()
    expect(page.get_by_text(f"asked by {ANN}")).to_be_visible()
    no_exception(page)

    # ... follows "compare with" to the Compare page (app/views/compare.py, ?jobs=ID,ID), with the other score run
    compare = page.get_by_role("link", name=f"Compare #{scored.id} with #{team['other']}")
    expect(compare).to_be_visible()
    compare.click()
    page.wait_for_url(f"{oidc_app}/compare?jobs=*")
    expect(page.get_by_role("heading", name="Compare")).to_be_visible()
    _drawn(page)
    assert "Page not found" not in page.inner_text("body")
    no_exception(page)

    # ... and is refused when he tries to remove the model, with the reason
    page.goto(oidc_app + f"/?model={model_id}")
    page.get_by_text("Remove tiny").first.click()  # a viewer is offered no Remove button, only the reason (app.auth)
    expect(page.get_by_text(f"{BOB} is a viewer: removing a model needs the admin role")).to_be_visible()
    assert page.get_by_role("button", name="Remove model").count() == 0
    no_exception(page)
    with session_scope(qp_settings) as s:
        assert repo.get_model(s, model_id).name == "tiny"  # refused by the application layer: nothing removed
    _sign_out(page)
