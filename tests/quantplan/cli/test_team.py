"""`quantplan users`, `quantplan audit`, `--as`, and `quantplan app` refusing an open address without a sign-in
(issue 44)."""

from __future__ import annotations

import json

from quantplan.services import access
from tests.factories import run_cli, run_cli_json


def test_users_set_role_as_a_named_operator_is_audited_and_exported(qp_settings, capsys) -> None:
    access.sign_in("ann@example.com")  # first: admin
    access.sign_in("bob@example.com")
    people = run_cli_json(capsys, "users", "--json")
    assert {p["name"]: p["role"] for p in people} == {"ann@example.com": "admin", "bob@example.com": "viewer"}
    code, out, err = run_cli(capsys, "--as", "ops", "users", "set-role", "bob@example.com", "member")
    assert code == 0, err
    assert out.strip() == "bob@example.com is now a member"
    code, out, err = run_cli(capsys, "users", "set-role", "nobody", "member")
    assert code == 1 and "no person named 'nobody'" in err
    log = run_cli_json(capsys, "audit", "--format", "json")
    assert [(a["actor"], a["action"], a["target"], a["detail"]) for a in log][0] == (
        "ops", "set-role", "user bob@example.com", {"from": "viewer", "to": "member"})
    code, out, _ = run_cli(capsys, "audit", "--action", "set-role")
    lines = out.strip().splitlines()
    assert lines[0] == "id,at,actor,action,target,detail" and len(lines) == 2 and ",ops,set-role," in lines[1]


def test_the_app_refuses_to_listen_on_an_open_address_without_a_sign_in(qp_settings, capsys) -> None:
    """In a process of its own, in a process group of its own: were the refusal gone, the command would start the
    app (and `up` a worker too), and the test ends them all at its deadline rather than leaving them running."""
    import os
    import signal
    import subprocess
    import sys

    env = dict(os.environ, QUANTPLAN_UI_ADDRESS="0.0.0.0", QUANTPLAN_UI_PORT="1")
    for command in ("app", "up"):
        proc = subprocess.Popen([sys.executable, "-m", "quantplan", command], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise AssertionError(f"quantplan {command} started on 0.0.0.0 with QUANTPLAN_AUTH=none") from None
        assert proc.returncode == 1, err
        assert "0.0.0.0 with QUANTPLAN_AUTH=none" in err and "QUANTPLAN_AUTH=oidc" in err, err
    assert json.loads(run_cli(capsys, "users", "--json")[1]) == []  # nothing was started, nobody was added


def test_note_add_and_list_from_the_command(qp_settings, capsys) -> None:
    from store import repo
    from store.db import session_scope

    with session_scope(qp_settings) as s:
        job = repo.create_job(s, kind="bench", params={}, queue="cpu", user="tester")
    [added] = run_cli_json(capsys, "--as", "ann", "note", "add", "job", str(job.id), "shipped", "--tag", "prod",
                           "--json")
    assert (added["author"], added["on"], added["text"], added["tags"]) == ("ann", f"job {job.id}", "shipped", ["prod"])
    code, out, _ = run_cli(capsys, "note", "list", "--tag", "prod")
    assert code == 0 and out.strip().endswith(f"ann on job {job.id}: shipped #prod")
    code, _, err = run_cli(capsys, "note", "add", "job", "424242", "x")
    assert code == 1 and "424242" in err
