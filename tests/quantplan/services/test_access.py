"""Roles enforced by the application layer (quantplan.services.access), whatever a page shows: a viewer's and a
member's forbidden actions are refused with a message that says who may and how to get the role; the first person
to sign in is admin; destructive actions are audited; server paths only under QUANTPLAN_MODEL_ROOTS (issue 44)."""

from __future__ import annotations

import os

import pytest

from quantplan.services import access
from quantplan.services import datasets as datasets_svc
from quantplan.services import jobs as jobs_svc
from quantplan.services import models as models_svc
from quantplan.services import plans as plans_svc
from quantplan.services import queue as queue_svc
from store import repo
from store.db import session_scope
from tests.factories import stored_model


@pytest.fixture
def team(qp_settings):
    """A signed-in team: ann (first: admin), bob and cyd (viewers), bob made a member; a model and a job of cyd's."""
    ann = access.sign_in("ann@example.com")
    viewer = access.sign_in("cyd@example.com")
    access.sign_in("bob@example.com")
    with access.acting(ann):
        access.set_role("bob@example.com", "member")
    member = access.Actor("bob@example.com", "member")
    with session_scope(qp_settings) as s:
        model = stored_model(s, "tiny")
        other_job = repo.create_job(s, kind="bench", params={}, queue="cpu", user="cyd@example.com")
    return {"admin": ann, "member": member, "viewer": viewer, "model": model, "other_job": other_job}


def test_the_first_person_to_sign_in_is_admin_and_later_ones_viewers(team) -> None:
    assert team["admin"].role == "admin" and team["viewer"].role == "viewer"
    assert access.sign_in("bob@example.com").role == "member"  # a role, once given, is kept at the next sign-in
    roles = {p.name: p.role for p in access.list_users() if p.role}  # not the names only recorded as who asked
    assert roles == {"ann@example.com": "admin", "bob@example.com": "member", "cyd@example.com": "viewer"}


def test_a_viewer_is_refused_every_write_by_the_services(team, tmp_path) -> None:
    model = team["model"]
    text = tmp_path / "calib.txt"
    text.write_text("some text to calibrate on\n")
    with access.acting(team["viewer"]):
        refusals = [
            lambda: queue_svc.submit("bench", {"device": "cpu", "m": [1]}),
            lambda: models_svc.register_demo(),
            lambda: plans_svc.save_plan(model.id, "p", {"default": "FP8"}),
            lambda: datasets_svc.add_dataset_file(text, "calibration"),
            lambda: jobs_svc.cancel_job(team["other_job"].id),
            lambda: models_svc.remove_model(model.id),
            lambda: models_svc.clear_cached_files(model.id),
            lambda: access.set_role("cyd@example.com", "admin"),
            lambda: access.audit_log(),
        ]
        for call in refusals:
            with pytest.raises(access.Forbidden, match=r"cyd@example.com is a viewer: .* needs the (member|admin) "
                                                       r"role\. An admin can give it"):
                call()
    assert jobs_svc.list_jobs() == [jobs_svc.get_job(team["other_job"].id)]  # nothing was queued
    assert plans_svc.list_plans(model.id) == [] and models_svc.get_model(model.id).name == "tiny"
    assert {p.name: p.role for p in access.list_users()}["cyd@example.com"] == "viewer"


def test_a_member_queues_and_saves_but_is_refused_what_only_an_admin_does(team) -> None:
    model = team["model"]
    with access.acting(team["member"]):
        job = queue_svc.submit("bench", {"device": "cpu", "m": [1]})
        plan = plans_svc.save_plan(model.id, "p", {"default": "FP8"})
        assert job.requested_by == plan.author == "bob@example.com"  # attributed to the person, not the process
        jobs_svc.cancel_job(job.id)  # their own
        for call, what in [(lambda: models_svc.remove_model(model.id), "removing a model"),
                           (lambda: models_svc.clear_cached_files(model.id), "clearing a model's cached files"),
                           (lambda: models_svc.register_path(os.getcwd()), "registering a path on the server"),
                           (lambda: jobs_svc.cancel_job(team["other_job"].id), "cancelling someone else's job"),
                           (lambda: access.set_role("bob@example.com", "admin"), "changing a role")]:
            with pytest.raises(access.Forbidden, match=f"bob@example.com is a member: {what} needs the admin role"):
                call()
    assert jobs_svc.get_job(team["other_job"].id).status == "queued"
    assert models_svc.get_model(model.id).name == "tiny"


def test_an_admins_destructive_actions_are_audited_with_who_and_what(team) -> None:
    with access.acting(team["admin"]):
        jobs_svc.cancel_job(team["other_job"].id)
        models_svc.clear_cached_files(team["model"].id)
        models_svc.remove_model(team["model"].id)
        log = access.audit_log()
    assert [(a.actor, a.action) for a in log] == [
        ("ann@example.com", "remove-model"), ("ann@example.com", "clear-cache"), ("ann@example.com", "cancel-job"),
        ("ann@example.com", "set-role"), ("ann@example.com", "first-admin")]
    assert log[0].target == f"model #{team['model'].id} tiny" and log[0].detail["sha256"] == team["model"].sha256
    assert log[3].detail == {"from": "viewer", "to": "member"}


def test_the_last_admin_keeps_the_role_and_an_unknown_role_or_person_is_refused(team) -> None:
    with access.acting(team["admin"]):
        with pytest.raises(access.Refused, match="only admin"):
            access.set_role("ann@example.com", "viewer")
        with pytest.raises(access.Refused, match="'owner' is not a role"):
            access.set_role("bob@example.com", "owner")
        with pytest.raises(LookupError, match="no person named 'zed'"):
            access.set_role("zed", "member")


def test_where_a_sign_in_is_required_nobody_signed_in_is_refused_not_the_operator(qp_settings, monkeypatch) -> None:
    monkeypatch.setattr(access, "_SIGNIN_REQUIRED", False)
    monkeypatch.setattr(access, "_SIGNED_IN", None)
    assert access.current() == access.operator() and access.operator().role == "admin"  # the CLI, auth none
    access.signin_required(lambda: None)
    with pytest.raises(access.Forbidden, match="sign in first"):
        queue_svc.submit("bench", {"device": "cpu", "m": [1]})
    assert jobs_svc.list_jobs() == []


def test_server_paths_only_under_the_model_roots_symlinks_resolved(qp_env, monkeypatch, tmp_path) -> None:
    from store.db import upgrade
    from store.settings import get_settings

    root, outside = tmp_path / "models", tmp_path / "secrets"
    (root / "good").mkdir(parents=True)
    outside.mkdir()
    (root / "sneaky").symlink_to(outside)  # inside the root by name, outside once resolved
    monkeypatch.setenv("QUANTPLAN_MODEL_ROOTS", str(root))
    get_settings.cache_clear()
    upgrade(get_settings())
    job = models_svc.register_path(str(root / "good"))
    assert job.params["source"] == str((root / "good").resolve())
    for path in (outside, root / "sneaky"):
        with pytest.raises(access.Refused, match="outside the folders models may be registered from"):
            models_svc.register_path(str(path))
    monkeypatch.setenv("QUANTPLAN_MODEL_ROOTS", "")
    monkeypatch.setenv("QUANTPLAN_AUTH", "header")  # a team without configured roots: nowhere
    get_settings.cache_clear()
    with pytest.raises(access.Refused, match="needs QUANTPLAN_MODEL_ROOTS"):
        models_svc.register_path(str(root / "good"))
    assert [j.id for j in jobs_svc.list_jobs()] == [job.id]
    assert [a.action for a in access.audit_log()] == ["register-path"]


@pytest.mark.parametrize(("address", "auth", "refused"), [
    ("127.0.0.1", "none", False), ("localhost", "none", False), ("::1", "none", False),
    ("0.0.0.0", "none", True), ("10.1.2.3", "none", True), ("example.org", "none", True),
    ("0.0.0.0", "oidc", False), ("0.0.0.0", "header", False)])
def test_the_app_binds_beyond_loopback_only_with_a_sign_in(qp_env, address, auth, refused) -> None:
    problem = access.binding_problem(address, auth)
    assert (problem is not None) == refused
    if refused:
        assert "QUANTPLAN_AUTH=oidc" in problem and "QUANTPLAN_UI_ADDRESS=127.0.0.1" in problem


def test_notes_and_tags_a_member_writes_on_a_run_and_a_viewer_may_only_read(team) -> None:
    from quantplan.services import notes as notes_svc

    job = team["other_job"]
    with access.acting(team["member"]):
        note = notes_svc.add_note("job", job.id, "  bad calibration text ", ["bad-cal", "bad-cal", "wikitext"])
        for args, match in [(("job", 99999, "x"), "no job"), (("run", job.id, "x"), "not on a 'run'"),
                            (("job", job.id, " "), "an empty note"),
                            (("job", job.id, "x", ["two words"]), "'two words'")]:
            with pytest.raises((access.Refused, LookupError), match=match):
                notes_svc.add_note(*args)
    with access.acting(team["viewer"]):
        with pytest.raises(access.Forbidden, match="writing a note needs the member role"):
            notes_svc.add_note("job", job.id, "shipped")
        assert notes_svc.notes("job", job.id) == [note]  # a viewer reads them
    assert (note.author, note.text, note.tags) == ("bob@example.com", "bad calibration text", ["bad-cal", "wikitext"])
    assert notes_svc.notes(tag="wikitext") == [note] and notes_svc.notes(tag="shipped") == []
