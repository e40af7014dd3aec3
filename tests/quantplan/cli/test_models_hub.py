"""`quantplan models add hf://ORG/NAME[@REVISION]` end to end against a local Hub (tests/hub_server.py): the
register job resolves, downloads, validates and stores in this process (the command runs it --local), records the
commit, reuses it, needs the token for a private repository, never writes the token anywhere, and refuses what it
must with nothing stored."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.factories import free_port, run_cli, run_cli_json
from tests.hub_server import (
    BIN_ONLY,
    GATED,
    MISSING,
    PRIVATE,
    PUBLIC,
    TOKEN,
    set_token,
)


def _models():
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        return [repo.get_model(s, m.id) for m in repo.list_models(s)]


def _jobs():
    from store import repo
    from store.db import session_scope

    with session_scope() as s:
        return repo.list_jobs(s, kind="register")


def _nothing_stored(settings) -> None:
    """No model row, no stored checkpoint, no download left behind."""
    artifacts = Path(str(settings.artifact_dir))
    assert _models() == []
    assert not [p for p in (artifacts / "models").glob("*") if p.is_dir()]
    assert not list((artifacts / "downloads").glob("*"))


def _file_gets(server, repo_id: str) -> int:
    return sum(1 for method, path, _ in server.requests if method == "GET" and path.startswith(f"/{repo_id}/resolve/"))


def test_models_add_hf_registers_the_model_with_its_resolved_commit_and_reuses_it(hub, qp_settings, capsys):
    main, v1 = hub.repos[PUBLIC].refs["main"], hub.repos[PUBLIC].refs["v1"]
    res = run_cli_json(capsys, "models", "add", f"hf://{PUBLIC}@main", "--json")
    assert res["commit"] == main and res["source"] == f"hf://{PUBLIC}@{main}" and not res["already"]
    assert res["name"] == "tiny-llama" and res["linears"] == 2 * 7 + 1
    [model] = _models()
    assert (model.source_kind, model.source_name) == ("hub", f"hf://{PUBLIC}@{main}")
    stored = Path(str(qp_settings.artifact_dir)) / model.path
    files = hub.repos[PUBLIC].commits[main]
    assert {p.name: p.read_bytes() for p in stored.iterdir()} == files  # the Hub's bytes, content-addressed
    assert stored.name == model.sha256
    assert not list((Path(str(qp_settings.artifact_dir)) / "downloads").glob("*"))  # moved into the store
    [job] = _jobs()
    assert {k: job.params.get(k) for k in ("hub", "revision")} == {"hub": PUBLIC, "revision": "main"}
    assert job.model_id == model.id

    fetched = _file_gets(hub, PUBLIC)
    code, out, err = run_cli(capsys, "models", "add", f"hf://{PUBLIC}")  # main again: the stored copy
    assert code == 0, err
    assert out.startswith(f"already registered model #{model.id} tiny-llama") and main in out
    assert _file_gets(hub, PUBLIC) == fetched  # nothing downloaded again
    assert len(_models()) == 1

    res = run_cli_json(capsys, "models", "add", "--hub", PUBLIC, "--revision", "v1", "--name", "tiny-v1", "--json")
    assert res["commit"] == v1 and res["name"] == "tiny-v1" and not res["already"]
    assert sorted(m.source_name for m in _models()) == sorted([f"hf://{PUBLIC}@{main}", f"hf://{PUBLIC}@{v1}"])
    code, _, err = run_cli(capsys, "models", "add", f"hf://{PUBLIC}@{v1}")  # the commit itself: the same model
    assert code == 0 and len(_models()) == 2


def test_a_private_repository_registers_only_with_the_token_which_appears_nowhere(hub, qp_settings, capsys,
                                                                                 monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, every level: the token must be in none of its lines
    code, _, err = run_cli(capsys, "models", "add", f"hf://{PRIVATE}")
    assert code == 1
    assert "no such repository on the Hub" in err and "no token was given: set QUANTPLAN_HF_TOKEN" in err
    _nothing_stored(qp_settings)
    assert not any(h.get("Authorization") for _, _, h in hub.requests)

    set_token(monkeypatch, "hf_not_a_token_the_hub_knows")
    code, _, err = run_cli(capsys, "models", "add", f"hf://{PRIVATE}")
    assert code == 1 and "the Hub refused the token in QUANTPLAN_HF_TOKEN (401, invalid credentials)" in err
    assert "hf_not_a_token_the_hub_knows" not in err
    _nothing_stored(qp_settings)

    set_token(monkeypatch, TOKEN)
    code, out, err = run_cli(capsys, "models", "add", f"hf://{PRIVATE}", "--name", "ours")
    assert code == 0, err
    [model] = _models()
    assert model.name == "ours" and model.source_name == f"hf://{PRIVATE}@{hub.repos[PRIVATE].refs['main']}"
    assert any(h.get("Authorization") == f"Bearer {TOKEN}" for _, _, h in hub.requests)  # it was used
    jobs = _jobs()
    assert len(jobs) == 3
    for job in jobs:  # no job row holds it: parameters, message, error, traceback, result
        assert TOKEN not in repr((job.params, job.message, job.error, job.traceback, job.result))
    assert TOKEN not in out + err
    assert TOKEN not in caplog.text and caplog.records  # the lines were captured, and the token is in none
    home = Path(str(qp_settings.home))
    for path in home.rglob("*"):  # nor any file the deployment wrote: the database, the stored model, ...
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_a_bin_only_repository_is_refused_with_nothing_downloaded_or_stored(hub, qp_settings, capsys):
    code, _, err = run_cli(capsys, "models", "add", f"hf://{BIN_ONLY}@main")
    assert code == 1
    assert "the weights are pickle files (pytorch_model.bin)" in err and "nothing was downloaded" in err
    _nothing_stored(qp_settings)
    assert _file_gets(hub, BIN_ONLY) == 0
    [job] = _jobs()
    assert job.status == "failed" and "pickle" in (job.error or "")


@pytest.mark.parametrize(("ref", "says"), [
    (f"hf://{GATED}", "is a gated repository"),
    (f"hf://{MISSING}", "no such repository on the Hub"),
    (f"hf://{PUBLIC}@no-such-branch", "has no revision 'no-such-branch'"),
])
def test_a_gated_or_missing_repository_or_an_unknown_revision_says_which_with_nothing_stored(
        hub, qp_settings, capsys, ref, says):
    code, _, err = run_cli(capsys, "models", "add", ref)
    assert code == 1 and says in err
    _nothing_stored(qp_settings)


def test_no_network_ends_the_job_saying_so(hub, qp_settings, capsys, monkeypatch):
    from tests.conftest import clear_settings_cache

    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    clear_settings_cache()
    code, _, err = run_cli(capsys, "models", "add", f"hf://{PUBLIC}")
    assert code == 1 and f"cannot reach the Hub at {closed}" in err
    _nothing_stored(qp_settings)


def test_a_model_over_the_size_setting_is_refused_before_the_download_with_both_numbers(hub, qp_settings, capsys,
                                                                                        monkeypatch):
    from quantcore.models.validation import human_size
    from tests.conftest import clear_settings_cache

    monkeypatch.setenv("QUANTPLAN_HUB_MAX_GIB", str(100 * 1024 / 2**30))  # 100 KiB
    clear_settings_cache()
    weights = len(hub.repos[PUBLIC].commits[hub.repos[PUBLIC].refs["main"]]["model.safetensors"])
    code, _, err = run_cli(capsys, "models", "add", f"hf://{PUBLIC}")
    assert code == 1
    assert f"safetensors weights are {human_size(weights)}" in err and "above the 100.0 KiB limit" in err
    assert "QUANTPLAN_HUB_MAX_GIB" in err
    assert _file_gets(hub, PUBLIC) == 0
    _nothing_stored(qp_settings)


def test_a_download_that_failed_resumes_when_the_command_is_run_again(hub, qp_settings, capsys):
    hub.broken.add((PUBLIC, "model.safetensors"))
    code, _, err = run_cli(capsys, "models", "add", f"hf://{PUBLIC}")
    assert code == 1 and "answered 500" in err and "A retry resumes the download" in err
    assert _models() == []
    [kept] = list((Path(str(qp_settings.artifact_dir)) / "downloads").iterdir())  # kept for the retry
    done = {p.name for p in kept.iterdir() if p.is_file()}
    assert done and "model.safetensors" not in done
    hub.broken.clear()
    before = {name: len(hub.gets(PUBLIC, name)) for name in done}
    code, out, err = run_cli(capsys, "models", "add", f"hf://{PUBLIC}")
    assert code == 0, err
    assert all(len(hub.gets(PUBLIC, name)) == before[name] for name in done)  # not fetched again
    assert len(_models()) == 1 and not kept.exists()


def test_a_checkpoint_that_needs_remote_code_is_refused_before_its_weights_are_downloaded(
        hub, qp_settings, capsys):
    import json

    repo = hub.repos[PUBLIC]
    files = dict(repo.commits[repo.refs["main"]])
    config = json.loads(files["config.json"])
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    repo.add_commit({**files, "config.json": json.dumps(config).encode(), "modeling_evil.py": b"import os"},
                    ref="evil")
    code, _, err = run_cli(capsys, "models", "add", f"hf://{PUBLIC}@evil")
    assert code == 1 and "needs remote code" in err and "Its weights were not downloaded" in err
    _nothing_stored(qp_settings)
    assert not hub.gets(PUBLIC, "modeling_evil.py")  # code is never downloaded
    assert not hub.gets(PUBLIC, "model.safetensors") and len(hub.gets(PUBLIC, "config.json")) == 1


def test_a_transfer_cut_short_is_resumed_by_a_range_request_and_progress_says_bytes_of_the_total(
        hub, qp_settings, capsys, monkeypatch):
    from quantcore.models.validation import human_size
    from tests.hub_server import WIDE

    monkeypatch.setattr("worker.runner.PROGRESS_INTERVAL_S", 0.0)  # every progress line written and printed
    files = hub.repos[WIDE].commits[hub.repos[WIDE].refs["main"]]
    hub.cut_after[(WIDE, "model.safetensors")] = 12 * 2**20
    code, out, err = run_cli(capsys, "models", "add", f"hf://{WIDE}")
    assert code == 0, err
    gets = hub.gets(WIDE, "model.safetensors")
    assert len(gets) == 2 and gets[1]["Range"].startswith("bytes=") and gets[1]["Range"] != "bytes=0-"
    total = human_size(sum(len(b) for b in files.values()))
    lines = [line for line in err.splitlines() if "downloading test-org/wide-llama@" in line]
    assert lines and all(f" of {total}" in line for line in lines)
    assert any(line.rstrip().endswith("left") for line in lines)  # an estimate of the time left while it runs
    assert f"{total} of {total}" in lines[-1]
