"""Sign-in with QUANTPLAN_AUTH=oidc, end to end: Streamlit's st.login against a real OpenID Connect provider running
in this process (oidc-provider-mock), in headless Chromium. The first person is admin and queues a job under their
name; a second is a viewer, whose attempt is refused by the application layer with the reason; both sign out; the
admin gives the viewer a role on the Users page, audited (issue 44)."""

from __future__ import annotations

import os
import sys

import pytest

from store import repo
from store.db import session_scope
from tests.e2e.browser import no_exception
from tests.e2e.test_browser import _settle
from tests.factories import Proc, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]


def _sign_in(tab, app_url: str, email: str) -> None:
    from playwright.sync_api import expect

    tab.goto(app_url + "/")
    _settle(tab)
    tab.get_by_role("button", name="Sign in").click()
    tab.get_by_placeholder("sub").fill(email)  # the provider's own form
    tab.get_by_role("button", name="Authorize").click()
    tab.wait_for_url(app_url + "/**")
    _settle(tab)
    expect(tab.get_by_text(f"Signed in as {email}")).to_be_visible()


def _sign_out(tab) -> None:
    from playwright.sync_api import expect

    app_url = tab.url.split("/", 3)[:3]
    tab.get_by_role("button", name="Sign out").click()
    # Streamlit's st.logout ends the session at the provider too (RP-initiated logout): its page confirms, then
    # sends the browser back to the app
    tab.get_by_role("button", name="End session").click()
    tab.wait_for_url("/".join(app_url) + "/**")
    _settle(tab)
    expect(tab.get_by_role("button", name="Sign in")).to_be_visible()


def _note(tab, app_url: str, job_id: int, text: str, tags: str) -> None:
    """Write a note on the Jobs page."""
    tab.goto(app_url + "/jobs")
    _settle(tab)
    tab.get_by_label("Job", exact=True).fill(str(job_id))
    tab.get_by_label("Note", exact=True).fill(text)
    tab.get_by_label("Tags", exact=True).fill(tags)
    tab.get_by_label("Tags", exact=True).press("Enter")
    _settle(tab, 1)
    tab.get_by_role("button", name="Add note").click()
    _settle(tab)


def _jobs(settings):
    with session_scope(settings) as s:
        return repo.list_jobs(s, limit=10)


def test_two_people_sign_in_act_within_their_roles_and_sign_out(oidc_app, page, qp_settings):  # noqa: F811
    from playwright.sync_api import expect

    page.goto(oidc_app + "/jobs")  # nothing is shown before a sign-in, whichever page is asked for
    _settle(page)
    expect(page.get_by_role("button", name="Sign in")).to_be_visible()
    assert page.get_by_text("Jobs").count() == 0 or page.get_by_role("heading", name="Jobs").count() == 0

    _sign_in(page, oidc_app, "ann@example.com")  # the first person: admin
    expect(page.get_by_text("Signed in as ann@example.com (admin)")).to_be_visible()
    page.get_by_role("button", name="Register the demo model").click()
    expect(page.get_by_text("Queued registration job")).to_be_visible()
    no_exception(page)
    [job] = _jobs(qp_settings)
    assert job.requested_by == "ann@example.com"  # the person, not the app's OS user
    _note(page, oidc_app, job.id, "first try", "demo")
    expect(page.get_by_text(f"Noted on job #{job.id} by ann@example.com.")).to_be_visible()
    _sign_out(page)

    _sign_in(page, oidc_app, "bob@example.com")  # a newcomer: viewer
    expect(page.get_by_text("Signed in as bob@example.com (viewer)")).to_be_visible()
    # a viewer is offered no control the application layer would refuse (tests/quantplan/services/test_access.py
    # proves the refusals whatever a page shows): the line that says which role it needs instead
    expect(page.get_by_text("bob@example.com is a viewer: queueing a job needs the member role").first).to_be_visible()
    assert page.get_by_role("button", name="Register the demo model").count() == 0
    no_exception(page)
    assert [j.id for j in _jobs(qp_settings)] == [job.id]  # nothing queued
    page.goto(oidc_app + "/jobs")
    _settle(page)
    expect(page.get_by_text("bob@example.com is a viewer: writing a note needs the member role")).to_be_visible()
    assert page.get_by_role("button", name="Add note").count() == 0
    from quantplan.services import notes as notes_svc

    assert [(n.author, n.text, n.tags) for n in notes_svc.notes("job", job.id)] == [
        ("ann@example.com", "first try", ["demo"])]
    page.goto(oidc_app + "/users")
    _settle(page)
    expect(page.get_by_text("You are a viewer: an admin changes roles here.")).to_be_visible()
    _sign_out(page)

    _sign_in(page, oidc_app, "ann@example.com")
    page.goto(oidc_app + "/users")
    _settle(page)
    page.get_by_label("Person").click()
    page.get_by_role("option", name="bob@example.com").click()
    page.get_by_label("Role").click()
    page.get_by_role("option", name="member").click()
    page.get_by_role("button", name="Set role").click()
    expect(page.get_by_text("bob@example.com is now a member.")).to_be_visible()
    no_exception(page)
    from quantplan.services import access

    assert {p.name: p.role for p in access.list_users() if p.role} == {"ann@example.com": "admin",
                                                                      "bob@example.com": "member"}
    assert [(a.actor, a.action, a.target) for a in access.audit_log()][0] == ("ann@example.com", "set-role",
                                                                              "user bob@example.com")
    _sign_out(page)


@pytest.fixture
def header_app(qp_settings, tmp_path):
    """The app with QUANTPLAN_AUTH=header, as behind oauth2-proxy."""
    port = free_port()
    env = dict(os.environ, QUANTPLAN_UI_PORT=str(port), QUANTPLAN_AUTH="header")
    proc = Proc([sys.executable, "-m", "quantplan", "app"], env, tmp_path / "app.log")
    try:
        proc.wait_for("URL: http", timeout=300)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


def test_behind_a_proxy_the_header_names_the_person_and_without_it_nobody_gets_in(header_app, page,  # noqa: F811
                                                                                   qp_settings):
    from playwright.sync_api import expect

    page.goto(header_app + "/jobs")
    _settle(page)
    expect(page.get_by_text("No access: nobody is signed in (the request carries no X-Forwarded-Email")).to_be_visible()
    assert page.get_by_role("button", name="Register the demo model").count() == 0
    page.set_extra_http_headers({"X-Forwarded-Email": "dana@example.com"})  # what oauth2-proxy adds
    page.goto(header_app + "/")
    _settle(page)
    expect(page.get_by_text("Signed in as dana@example.com (admin)")).to_be_visible()
    no_exception(page)
    from quantplan.services import access

    assert [(p.name, p.role) for p in access.list_users() if p.role] == [("dana@example.com", "admin")]
